"""What the Hugging Face families' name tables share: the rule and table types, the transforms between the two
layouts, and the rules of the parts several families have (Llama's attention and names, a SwiGLU MLP).

A table is a list of `Rule`s read in both directions (weights.py): import joins each rule's HF tensors into
ours, export splits ours back into the HF tensors, and the HF shapes a configuration implies come from the
same rules. Names are templates: `{layer}` runs over the layers, `{expert}` over the routed experts, `{depth}`
over the multi-token prediction modules (DeepSeek-V3's, stored as the layers after the decoder's; Nemotron 3's, block
by block under mtp.layers). A family's own table, and the rules and transforms only it has, are in its module
(families/).

The transforms between the two layouts shared here:
  SAME         the tensor as it is
  VOCAB_ROWS   a vocabulary table: export drops our padding rows (import pads at load time)
  STACKED      [gate; up] rows stacked into one fc1, for the dense MLP and every expert
  QKV          separate q, k, v -> fused per query group (model/attention/self_attention.py's layout)
  transposed() a transform of HF tensors stored as [in, out] (GPT-2's Conv1D, gpt-oss's experts)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_lite.config.layer_specs import LayerSpec
from megatron_lite.config.sections import ModelConfig

Shape = tuple[int, ...]


def _query_rows_per_group(config: ModelConfig) -> int:
    """Head-sized query rows per query group: its heads, each followed by its gate with --attention-output-gate
    (HF's q_proj holds [q_h; gate_h] per head, Megatron's layout too)."""
    return config.num_attention_heads // config.num_query_groups * (2 if config.attention_output_gate else 1)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Separate q [nh*d (x2 with output gates), ..], k, v [ng*d, ..] -> fused per query group."""
    ng, d = config.num_query_groups, config.head_dim
    per_group = _query_rows_per_group(config)
    rest = q.shape[1:]
    q = q.reshape(ng, per_group * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    ng, d = config.num_query_groups, config.head_dim
    per_group = _query_rows_per_group(config)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


@dataclass(frozen=True)
class Transform:
    """`join` makes our tensor from the HF tensors (in the rule's order); `split` is its inverse."""

    join: Callable[[list[torch.Tensor], ModelConfig], torch.Tensor]
    split: Callable[[torch.Tensor, ModelConfig], list[torch.Tensor]]


SAME = Transform(lambda hf, m: hf[0], lambda t, m: [t])
VOCAB_ROWS = Transform(lambda hf, m: hf[0], lambda t, m: [t[:m.vocab_size]])
STACKED = Transform(lambda hf, m: torch.cat(hf), lambda t, m: list(t.chunk(2)))
QKV = Transform(lambda hf, m: fuse_qkv(*hf, m), lambda t, m: list(split_qkv(t, m)))


def transposed(inner: Transform) -> Transform:
    """`inner` applied to HF tensors stored as [in, out]."""
    return Transform(lambda hf, m: inner.join([t.t() for t in hf], m),
                     lambda t, m: [piece.t() for piece in inner.split(t, m)])


@dataclass(frozen=True)
class Rule:
    """Our tensor `ours` is `transform.join` of the HF tensors `theirs`, whose shapes are `shapes(m)`. With
    `stacked_experts`, each of `theirs` holds every routed expert of the layer on a leading axis (gpt-oss) and
    `ours` is one expert's (`{expert}`), joined from its slices."""

    ours: str
    theirs: tuple[str, ...]
    shapes: Callable[[ModelConfig], tuple[Shape, ...]]
    transform: Transform = SAME
    stacked_experts: bool = False


@dataclass(frozen=True)
class NameTable:
    """The rules of a family: before the layers (`head`), of a decoder layer of a spec (`layer(spec)`, with
    `{layer}`, and `{expert}` in expert rules: the family says which rules each kind of layer takes), after
    (`tail`). `mtp` holds a multi-token prediction module's own rules (`{depth}` ours; `{layer}` its first layer,
    which DeepSeek-V3 stores it as, and that layer's `blocks`); its layers take the rules `mtp_layer(spec)` gives
    (None: the decoder layers') under our `mtp.layers.{depth}.transformer_layer.` (`transformer_layers.{i}.` where
    a depth has several). `mtp` None: the family stores no such modules. `blocks(i)` gives more placeholders of layer
    i (a decoder or a multi-token prediction layer) where HF stores its parts as blocks of their own (Nemotron-H's
    `{mixer}` and `{mlp}`; a Nemotron 3 prediction depth's `{first}` and `{last}`); a family without them stores one
    layer per depth."""

    head: list[Rule]
    layer: Callable[[LayerSpec], list[Rule]]
    tail: list[Rule]
    mtp: list[Rule] | None = None
    blocks: Callable[[int], dict] | None = None
    mtp_layer: Callable[[LayerSpec], list[Rule]] | None = None


def _h(m):
    return m.hidden_size


def _q(m):
    return m.num_attention_heads * m.head_dim


def _kv(m):
    return m.num_query_groups * m.head_dim


def _q_proj_rows(m):
    """HF's q_proj rows: the query heads, each followed by its gate with --attention-output-gate."""
    return _q(m) * (2 if m.attention_output_gate else 1)


def output_layer(m: ModelConfig, hf_name: str) -> list[Rule]:
    return ([Rule("output_layer.weight", (hf_name,), lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS)]
            if m.untie_embeddings_and_output_weights else [])


def llama_attention(m: ModelConfig) -> list[Rule]:
    """Norms and attention of a Llama layer (and Qwen2's q/k/v biases, gpt-oss's biases on q, k, v and o, Qwen3's
    per-head q/k norms)."""
    ours, attn = "decoder.layers.{layer}.", "model.layers.{layer}.self_attn."
    rules = [Rule(ours + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",),
                  lambda m: ((_h(m),),)),
             Rule(ours + "pre_mlp_layernorm.weight", ("model.layers.{layer}.post_attention_layernorm.weight",),
                  lambda m: ((_h(m),),)),
             Rule(ours + "self_attention.linear_qkv.weight",
                  (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                  lambda m: ((_q_proj_rows(m), _h(m)), (_kv(m), _h(m)), (_kv(m), _h(m))), QKV),
             Rule(ours + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), lambda m: ((_h(m), _q(m)),))]
    if m.add_qkv_bias or not m.disable_bias_linear:
        rules.append(Rule(ours + "self_attention.linear_qkv.bias",
                          (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                          lambda m: ((_q_proj_rows(m),), (_kv(m),), (_kv(m),)), QKV))
    if not m.disable_bias_linear:
        rules.append(Rule(ours + "self_attention.linear_proj.bias", (attn + "o_proj.bias",), lambda m: ((_h(m),),)))
    if m.qk_layernorm:
        rules += [Rule(ours + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",),
                       lambda m: ((m.head_dim,),)),
                  Rule(ours + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",),
                       lambda m: ((m.head_dim,),))]
    return rules


def swiglu_mlp(ours: str, theirs: str, ffn: Callable[[ModelConfig], int],
               names=("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """A SwiGLU MLP: HF's gate, up and down projections -> our fc1 ([gate; up]) and fc2."""
    gate, up, down = names
    return [Rule(ours + "linear_fc1.weight", (f"{theirs}{gate}.weight", f"{theirs}{up}.weight"),
                 lambda m: ((ffn(m), _h(m)), (ffn(m), _h(m))), STACKED),
            Rule(ours + "linear_fc2.weight", (f"{theirs}{down}.weight",), lambda m: ((_h(m), ffn(m)),))]


def llama_names(m: ModelConfig, layer: Callable[[LayerSpec], list[Rule]], mtp: list[Rule] | None = None) -> NameTable:
    """A table under Llama's names around the layers (model.embed_tokens, model.norm, lm_head); `layer` gives the
    rules of a layer of a spec."""
    return NameTable(
        head=[Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                   lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS)],
        layer=layer,
        tail=[Rule("decoder.final_layernorm.weight", ("model.norm.weight",), lambda m: ((_h(m),),)),
              *output_layer(m, "lm_head.weight")],
        mtp=mtp)
