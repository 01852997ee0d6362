"""One name table per Hugging Face family: which HF tensors make each global megatron_lite tensor, and how.

A table is a list of `Rule`s read in both directions (weights.py): import joins each rule's HF tensors into
ours, export splits ours back into the HF tensors, and the HF shapes a configuration implies come from the
same rules. Names are templates: `{layer}` runs over the layers, `{expert}` over the routed experts, `{depth}`
over the multi-token prediction modules (DeepSeek-V3's, stored as the layers after the decoder's).
Adding a family is one function here returning its table (and its config.json mapping in configs.py).

The transforms between the two layouts:
  SAME         the tensor as it is
  VOCAB_ROWS   a vocabulary table: export drops our padding rows (import pads at load time)
  STACKED      [gate; up] rows stacked into one fc1, for the dense MLP and every expert
  QKV          separate q, k, v -> fused per query group (model/attention/self_attention.py's layout)
  PACKED_QKV   GPT-2's one [q; k; v] tensor -> fused per query group
  GDN_PROJECTION, GDN_CONV  Qwen3-Next's Gated DeltaNet projections and convolution -> ours, per key head
  INTERLEAVED_GATE_UP  gpt-oss's [in, 2 ffn] gate_up_proj, gate and up in alternate columns -> our fc1 [gate; up]
  transposed() GPT-2's Conv1D stores weights as [in, out]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_lite.config.layer_specs import GATED_DELTA_NET, LayerSpec
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
PACKED_QKV = Transform(lambda hf, m: fuse_qkv(*hf[0].chunk(3), m), lambda t, m: [torch.cat(split_qkv(t, m))])


def _per_key_head(parts: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """Tensors whose rows are laid out per linear-attention key head -> one, each key head's rows of every part
    together (model/linear_attention/gated_delta_net.py's layout)."""
    heads = config.linear_num_key_heads
    return torch.cat([part.reshape(heads, -1, *part.shape[1:]) for part in parts], dim=1).flatten(0, 1)


def _from_key_heads(t: torch.Tensor, sizes: list[int], config: ModelConfig) -> list[torch.Tensor]:
    """Inverse of `_per_key_head`: the parts, of `sizes` rows per key head."""
    grouped = t.reshape(config.linear_num_key_heads, -1, *t.shape[1:])
    return [part.flatten(0, 1) for part in grouped.split(sizes, dim=1)]


def _projection_rows(config: ModelConfig) -> list[int]:
    """Rows per linear-attention key head of Qwen3-Next's in_proj_qkvz (q, k, and its value heads' v and z) and
    of in_proj_ba (b and a of its value heads)."""
    group = config.linear_num_value_heads // config.linear_num_key_heads
    return [2 * config.linear_key_head_dim + 2 * group * config.linear_value_head_dim, 2 * group]


def _conv_rows(config: ModelConfig) -> list[int]:
    """Channels per key head of the convolution's q, k and v."""
    group = config.linear_num_value_heads // config.linear_num_key_heads
    return [config.linear_key_head_dim, config.linear_key_head_dim, group * config.linear_value_head_dim]


# Qwen3-Next's in_proj_qkvz (per key head [q, k, v, z]) and in_proj_ba (per key head [b, a]) -> our in_proj
GDN_PROJECTION = Transform(_per_key_head, lambda t, m: _from_key_heads(t, _projection_rows(m), m))
def _split_qkv_channels(qkv: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """Qwen3.5's in_proj_qkv or the convolution's channels, [q; k; v] each over all key heads -> q, k, v."""
    return list(qkv.split([config.linear_num_key_heads * rows for rows in _conv_rows(config)]))


def _separate_projections_to_ours(hf: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    qkv, z, b, a = hf
    return _per_key_head([*_split_qkv_channels(qkv, config), z, b, a], config)


def _ours_to_separate_projections(t: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    q_rows, k_rows, v_rows = _conv_rows(config)
    group = config.linear_num_value_heads // config.linear_num_key_heads
    q, k, v, z, b, a = _from_key_heads(t, [q_rows, k_rows, v_rows, v_rows, group, group], config)
    return [torch.cat([q, k, v]), z, b, a]


# Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a -> our in_proj
GDN_SEPARATE_PROJECTIONS = Transform(_separate_projections_to_ours, _ours_to_separate_projections)
# Qwen3-Next's conv1d ([q; k; v] channels, each over all key heads) -> ours, per key head [q, k, v]
GDN_CONV = Transform(lambda hf, m: _per_key_head(_split_qkv_channels(hf[0], m), m),
                     lambda t, m: [torch.cat(_from_key_heads(t, _conv_rows(m), m))])


def _interleaved_to_stacked(t: torch.Tensor) -> torch.Tensor:
    """[..., 2 n] with gate and up in alternate entries of the last dimension -> [..., 2 n] as [gate; up]."""
    return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)


def _stacked_to_interleaved(t: torch.Tensor) -> torch.Tensor:
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


# gpt-oss's gate_up_proj [h, 2 ffn] (x @ W) -> our fc1 [2 ffn, h]; its bias [2 ffn] alike
INTERLEAVED_GATE_UP = Transform(lambda hf, m: _interleaved_to_stacked(hf[0]).t(),
                                lambda t, m: [_stacked_to_interleaved(t.t()).contiguous()])
INTERLEAVED_GATE_UP_BIAS = Transform(lambda hf, m: _interleaved_to_stacked(hf[0]),
                                     lambda t, m: [_stacked_to_interleaved(t)])


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
    """The rules of a family: before the layers, per layer (`{layer}`, and `{expert}` in expert rules), after.
    With `dense_layer`, `layer` holds the MoE layers' rules and `dense_layer` those of the dense layers of
    --moe-layer-freq (DeepSeek-V3's first layers). `mtp` holds a multi-token prediction module's own rules
    (`{depth}` ours, `{layer}` the HF layer it is stored as); its transformer layer takes the decoder layers'
    rules under our `mtp.layers.{depth}.transformer_layer.` (None: the family stores no such modules).
    `linear_layer(moe)` gives the rules of a linear-attention layer (--linear-attention-freq)."""

    head: list[Rule]
    layer: list[Rule]
    tail: list[Rule]
    dense_layer: list[Rule] | None = None
    mtp: list[Rule] | None = None
    linear_layer: Callable[[bool], list[Rule]] | None = None

    def rules_of(self, spec: LayerSpec) -> list[Rule]:
        """The rules of a layer of `spec`: `linear_layer(moe)` for a Gated DeltaNet layer (Qwen3-Next), else
        `layer`, or `dense_layer` for a dense layer where the family has one."""
        moe = spec.routed_experts
        if spec.mixer == GATED_DELTA_NET:
            return self.linear_layer(moe)
        return self.layer if moe or self.dense_layer is None else self.dense_layer


def _h(m):
    return m.hidden_size


def _q(m):
    return m.num_attention_heads * m.head_dim


def _kv(m):
    return m.num_query_groups * m.head_dim


def _q_proj_rows(m):
    """HF's q_proj rows: the query heads, each followed by its gate with --attention-output-gate."""
    return _q(m) * (2 if m.attention_output_gate else 1)


def _output_layer(m: ModelConfig, hf_name: str) -> list[Rule]:
    return ([Rule("output_layer.weight", (hf_name,), lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS)]
            if m.untie_embeddings_and_output_weights else [])


def _llama_attention(m: ModelConfig) -> list[Rule]:
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


def _swiglu_mlp(ours: str, theirs: str, ffn: Callable[[ModelConfig], int],
                names=("gate_proj", "up_proj", "down_proj")) -> list[Rule]:
    """A SwiGLU MLP: HF's gate, up and down projections -> our fc1 ([gate; up]) and fc2."""
    gate, up, down = names
    return [Rule(ours + "linear_fc1.weight", (f"{theirs}{gate}.weight", f"{theirs}{up}.weight"),
                 lambda m: ((ffn(m), _h(m)), (ffn(m), _h(m))), STACKED),
            Rule(ours + "linear_fc2.weight", (f"{theirs}{down}.weight",), lambda m: ((_h(m), ffn(m)),))]


def _llama_table(m: ModelConfig, mlp: list[Rule]) -> NameTable:
    return NameTable(
        head=[Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                   lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS)],
        layer=_llama_attention(m) + mlp,
        tail=[Rule("decoder.final_layernorm.weight", ("model.norm.weight",), lambda m: ((_h(m),),)),
              *_output_layer(m, "lm_head.weight")])


def llama_table(m: ModelConfig) -> NameTable:
    """Llama, Qwen2 and Qwen3: a dense SwiGLU MLP in every layer."""
    return _llama_table(m, _swiglu_mlp("decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp.",
                                       lambda m: m.ffn_hidden_size))


def mixtral_table(m: ModelConfig) -> NameTable:
    """Mixtral: a router and experts w1 (gate), w3 (up), w2 (down) in every layer."""
    moe = "model.layers.{layer}.block_sparse_moe."
    return _llama_table(m, [
        Rule("decoder.layers.{layer}.mlp.router.weight", (moe + "gate.weight",),
             lambda m: ((m.num_experts, _h(m)),)),
        *_swiglu_mlp("decoder.layers.{layer}.mlp.experts.{expert}.", moe + "experts.{expert}.",
                     lambda m: m.moe_ffn_hidden_size, names=("w1", "w3", "w2"))])


def _qwen_moe_mlp(m: ModelConfig) -> list[Rule]:
    """A Qwen MoE layer's router (gate) and experts gate/up/down_proj, and the shared expert with its sigmoid gate
    where the model has one."""
    ours, theirs = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
    mlp = [Rule(ours + "router.weight", (theirs + "gate.weight",), lambda m: ((m.num_experts, _h(m)),)),
           *_swiglu_mlp(ours + "experts.{expert}.", theirs + "experts.{expert}.", lambda m: m.moe_ffn_hidden_size)]
    if m.moe_shared_expert_intermediate_size:
        mlp += [*_swiglu_mlp(ours + "shared_experts.", theirs + "shared_expert.",
                             lambda m: m.moe_shared_expert_intermediate_size),
                Rule(ours + "shared_experts.gate_weight", (theirs + "shared_expert_gate.weight",),
                     lambda m: ((1, _h(m)),))]
    return mlp


def qwen_moe_table(m: ModelConfig) -> NameTable:
    """Qwen3-MoE and Qwen2-MoE: a router and experts in every layer, and Qwen2-MoE's gated shared expert."""
    return _llama_table(m, _qwen_moe_mlp(m))


def _gated_delta_net(m: ModelConfig, separate_projections: bool) -> list[Rule]:
    """Qwen3-Next's (or, with `separate_projections`, Qwen3.5's) linear_attn (Gated DeltaNet) -> ours
    (model/linear_attention/gated_delta_net.py)."""
    ours, theirs = "decoder.layers.{layer}.self_attention.", "model.layers.{layer}.linear_attn."
    keys = m.linear_num_key_heads * m.linear_key_head_dim
    values = m.linear_num_value_heads * m.linear_value_head_dim
    heads = m.linear_num_value_heads
    if separate_projections:
        projection = Rule(ours + "in_proj.weight", tuple(f"{theirs}in_proj_{part}.weight" for part in
                                                         ("qkv", "z", "b", "a")),
                          lambda m: ((2 * keys + values, _h(m)), (values, _h(m)), (heads, _h(m)), (heads, _h(m))),
                          GDN_SEPARATE_PROJECTIONS)
    else:
        projection = Rule(ours + "in_proj.weight", (theirs + "in_proj_qkvz.weight", theirs + "in_proj_ba.weight"),
                          lambda m: ((2 * keys + 2 * values, _h(m)), (2 * heads, _h(m))), GDN_PROJECTION)
    return [projection,
            Rule(ours + "conv1d_weight", (theirs + "conv1d.weight",),
                 lambda m: ((2 * keys + values, 1, m.linear_conv_kernel_dim),), GDN_CONV),
            Rule(ours + "A_log", (theirs + "A_log",), lambda m: ((heads,),)),
            Rule(ours + "dt_bias", (theirs + "dt_bias",), lambda m: ((heads,),)),
            Rule(ours + "norm_weight", (theirs + "norm.weight",), lambda m: ((m.linear_value_head_dim,),)),
            Rule(ours + "out_proj.weight", (theirs + "out_proj.weight",), lambda m: ((_h(m), values),))]


def qwen3_next_table(m: ModelConfig, separate_projections: bool = False) -> NameTable:
    """Qwen3-Next: Gated DeltaNet layers between gated softmax-attention layers (Qwen3's attention with an output
    gate in q_proj), zero-centred norms (stored as HF stores them), Qwen2-MoE's experts with a gated shared
    expert, dense SwiGLU MLPs in mlp_only_layers. Qwen3.5 (its text models) is the same network with the Gated
    DeltaNet input projection stored as four tensors."""
    attention = _llama_attention(m)
    norms = attention[:2]  # input_layernorm and post_attention_layernorm, in both kinds of layer
    dense = _swiglu_mlp("decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp.", lambda m: m.ffn_hidden_size)
    moe = _qwen_moe_mlp(m) if m.num_experts else dense
    table = _llama_table(m, [])
    return NameTable(head=table.head, layer=attention + moe, tail=table.tail, dense_layer=attention + dense,
                     linear_layer=lambda is_moe: norms + _gated_delta_net(m, separate_projections)
                     + (moe if is_moe else dense))


def gpt_oss_table(m: ModelConfig) -> NameTable:
    """gpt-oss: Llama's attention with biases on q, k, v and o and a learned sink per head; a router with a bias;
    experts stored stacked per layer, gate and up interleaved in gate_up_proj, weights as [in, out]."""
    ours, attn, moe = "decoder.layers.{layer}.", "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
    expert = ours + "mlp.experts.{expert}."
    ffn = m.moe_ffn_hidden_size
    layer = _llama_attention(m) + [
        Rule(ours + "self_attention.sinks", (attn + "sinks",), lambda m: ((m.num_attention_heads,),)),
        Rule(ours + "mlp.router.weight", (moe + "router.weight",), lambda m: ((m.num_experts, _h(m)),)),
        Rule(ours + "mlp.router.bias", (moe + "router.bias",), lambda m: ((m.num_experts,),)),
        Rule(expert + "linear_fc1.weight", (moe + "experts.gate_up_proj",),
             lambda m: ((m.num_experts, _h(m), 2 * ffn),), INTERLEAVED_GATE_UP, stacked_experts=True),
        Rule(expert + "linear_fc1.bias", (moe + "experts.gate_up_proj_bias",), lambda m: ((m.num_experts, 2 * ffn),),
             INTERLEAVED_GATE_UP_BIAS, stacked_experts=True),
        Rule(expert + "linear_fc2.weight", (moe + "experts.down_proj",), lambda m: ((m.num_experts, ffn, _h(m)),),
             transposed(SAME), stacked_experts=True),
        Rule(expert + "linear_fc2.bias", (moe + "experts.down_proj_bias",), lambda m: ((m.num_experts, _h(m)),),
             stacked_experts=True)]
    table = _llama_table(m, [])
    return NameTable(head=table.head, layer=layer, tail=table.tail)


def gpt2_table(m: ModelConfig) -> NameTable:
    """GPT-2: LayerNorms and linears with biases, learned positions, a packed [q; k; v] c_attn."""
    ours, theirs = "decoder.layers.{layer}.", "transformer.h.{layer}."
    layer = []
    for our_norm, their_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
        layer += [Rule(f"{ours}{our_norm}.{p}", (f"{theirs}{their_norm}.{p}",), lambda m: ((_h(m),),))
                  for p in ("weight", "bias")]
    layer += [Rule(ours + "self_attention.linear_qkv.weight", (theirs + "attn.c_attn.weight",),
                   lambda m: ((_h(m), 3 * _h(m)),), transposed(PACKED_QKV)),
              Rule(ours + "self_attention.linear_qkv.bias", (theirs + "attn.c_attn.bias",),
                   lambda m: ((3 * _h(m),),), PACKED_QKV)]
    for our_linear, their_linear, fan_in, fan_out in (
            ("self_attention.linear_proj", "attn.c_proj", _h, _h),
            ("mlp.linear_fc1", "mlp.c_fc", _h, lambda m: m.ffn_hidden_size),
            ("mlp.linear_fc2", "mlp.c_proj", lambda m: m.ffn_hidden_size, _h)):
        layer += [Rule(f"{ours}{our_linear}.weight", (f"{theirs}{their_linear}.weight",),
                       lambda m, i=fan_in, o=fan_out: ((i(m), o(m)),), transposed(SAME)),
                  Rule(f"{ours}{our_linear}.bias", (f"{theirs}{their_linear}.bias",),
                       lambda m, o=fan_out: ((o(m),),))]
    return NameTable(
        head=[Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",),
                   lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS),
              Rule("embedding.position_embeddings", ("transformer.wpe.weight",),
                   lambda m: ((m.max_position_embeddings, _h(m)),))],
        layer=layer,
        tail=[Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), lambda m: ((_h(m),),)),
              Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), lambda m: ((_h(m),),)),
              *_output_layer(m, "lm_head.weight")])


def _latent_attention(m: ModelConfig) -> list[Rule]:
    """Norms and multi-latent attention of a DeepSeek-V3 layer (model/attention/mla.py's names; HF's in the same
    layouts)."""
    ours, attn = "decoder.layers.{layer}.", "model.layers.{layer}.self_attn."
    heads, q_dim = m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim

    def rule(our_name, their_name, shape):
        return Rule(f"{ours}{our_name}", (f"{attn}{their_name}",), lambda m: (shape,))

    rules = [Rule(ours + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",),
                  lambda m: ((_h(m),),)),
             Rule(ours + "pre_mlp_layernorm.weight", ("model.layers.{layer}.post_attention_layernorm.weight",),
                  lambda m: ((_h(m),),))]
    if m.q_lora_rank is None:
        rules.append(rule("self_attention.linear_q_proj.weight", "q_proj.weight", (heads * q_dim, _h(m))))
    else:
        rules += [rule("self_attention.linear_q_down_proj.weight", "q_a_proj.weight", (m.q_lora_rank, _h(m))),
                  rule("self_attention.q_layernorm.weight", "q_a_layernorm.weight", (m.q_lora_rank,)),
                  rule("self_attention.linear_q_up_proj.weight", "q_b_proj.weight", (heads * q_dim, m.q_lora_rank))]
    return rules + [
        rule("self_attention.linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight",
             (m.kv_lora_rank + m.qk_pos_emb_head_dim, _h(m))),
        rule("self_attention.kv_layernorm.weight", "kv_a_layernorm.weight", (m.kv_lora_rank,)),
        rule("self_attention.linear_kv_up_proj.weight", "kv_b_proj.weight",
             (heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank)),
        rule("self_attention.linear_proj.weight", "o_proj.weight", (_h(m), heads * m.v_head_dim))]


def deepseek_v3_table(m: ModelConfig) -> NameTable:
    """DeepSeek-V3 (and Moonlight, Kimi K2): multi-latent attention; dense SwiGLU MLPs in the first layers, then a
    sigmoid router with its expert bias (e_score_correction_bias), routed experts and a shared expert."""
    ours, theirs = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
    moe = [Rule(ours + "router.weight", (theirs + "gate.weight",), lambda m: ((m.num_experts, _h(m)),)),
           Rule(ours + "router.expert_bias", (theirs + "gate.e_score_correction_bias",), lambda m: ((m.num_experts,),)),
           *_swiglu_mlp(ours + "experts.{expert}.", theirs + "experts.{expert}.", lambda m: m.moe_ffn_hidden_size),
           *_swiglu_mlp(ours + "shared_experts.", theirs + "shared_experts.",
                        lambda m: m.moe_shared_expert_intermediate_size)]
    dense = _swiglu_mlp(ours, theirs, lambda m: m.ffn_hidden_size)
    attention = _latent_attention(m)
    table = _llama_table(m, [])
    return NameTable(head=table.head, layer=attention + moe, tail=table.tail, dense_layer=attention + dense,
                     mtp=_deepseek_v3_mtp(m))


def _deepseek_v3_mtp(m: ModelConfig) -> list[Rule]:
    """DeepSeek-V3's multi-token prediction module as published (layer num_hidden_layers + depth): its norms, the
    2h -> h projection and the final norm (shared_head.norm), and copies of the embedding and output layer that
    the module shares with the model (embed_tokens, shared_head.head), read back as the model's own tables."""
    ours, theirs = "mtp.layers.{depth}.", "model.layers.{layer}."
    head = "output_layer.weight" if m.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
    return [Rule("embedding.word_embeddings.weight", (theirs + "embed_tokens.weight",),
                 lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS),
            Rule(ours + "enorm.weight", (theirs + "enorm.weight",), lambda m: ((_h(m),),)),
            Rule(ours + "hnorm.weight", (theirs + "hnorm.weight",), lambda m: ((_h(m),),)),
            Rule(ours + "eh_proj.weight", (theirs + "eh_proj.weight",), lambda m: ((_h(m), 2 * _h(m)),)),
            Rule(ours + "final_layernorm.weight", (theirs + "shared_head.norm.weight",), lambda m: ((_h(m),),)),
            Rule(head, (theirs + "shared_head.head.weight",), lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS)]


NAME_TABLES: dict[str, Callable[[ModelConfig], NameTable]] = {
    "llama": llama_table, "qwen2": llama_table, "qwen3": llama_table, "gpt2": gpt2_table, "mixtral": mixtral_table,
    "qwen3_moe": qwen_moe_table, "qwen2_moe": qwen_moe_table, "deepseek_v3": deepseek_v3_table,
    "qwen3_next": qwen3_next_table, "qwen3_5_text": lambda m: qwen3_next_table(m, separate_projections=True),
    "qwen3_5_moe_text": lambda m: qwen3_next_table(m, separate_projections=True), "gpt_oss": gpt_oss_table}
