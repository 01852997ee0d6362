"""Qwen3-Next and Qwen3.5's text models (transformers' qwen3_next, qwen3_5_text, qwen3_5_moe_text): their
config.json <-> megatron_lite model flags, the network they recognise and their name tables.

Qwen3-Next interleaves Gated DeltaNet layers (layer_types, --linear-attention-freq) with Qwen3 attention gated per
head (--attention-output-gate) and partly rotated (--rotary-percent), its norms zero-centred
(--apply-layernorm-1p, stored as HF stores them), and Qwen2-MoE's experts with a gated shared expert (dense SwiGLU
MLPs in mlp_only_layers). Qwen3.5 is the same network, dense (qwen3_5_text) or with experts in every layer
(qwen3_5_moe_text), its Gated DeltaNet input projection stored as four tensors; published as vision-language
models (qwen3_5, qwen3_5_moe) whose language model converts. A model trained here exports as qwen3_next, a
converted Qwen3.5 as itself.
"""

from __future__ import annotations

import torch

from megatron_lite.config.layer_pattern import layer_list_expression, linear_attention_pattern, moe_layer_pattern
from megatron_lite.config.layer_specs import GATED_DELTA_NET
from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse, required
from megatron_lite.hf.families.family import Family, refuse_network
from megatron_lite.hf.families.gpt_oss import gpt_oss_options
from megatron_lite.hf.families.qwen_moe import qwen_moe_mlp
from megatron_lite.hf.llama_config import llama_config, llama_values
from megatron_lite.hf.name_tables import NameTable, Rule, Transform, llama_attention, llama_names, swiglu_mlp

# Gated DeltaNet's shapes: the same keys in config.json as the flags
_LINEAR_ATTENTION_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                          "linear_num_key_heads", "linear_num_value_heads")


def _layers(hf: dict) -> tuple[list[bool], list[bool]]:
    """(linear attention, MoE) of each layer: `layer_types` (else every full_attention_interval-th layer softmax
    attention), and experts where num_experts > 0, outside mlp_only_layers, every decoder_sparse_step-th layer
    (transformers' rules)."""
    layers = required(hf, "num_hidden_layers")
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                      for i in range(layers)]
    refuse(len(types) != layers or not set(types) <= {"linear_attention", "full_attention"},
           f"layer_types {types!r}")
    dense, step, experts = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1), hf.get("num_experts")
    moe = [bool(experts) and i not in dense and (i + 1) % step == 0 for i in range(layers)]
    return [kind == "linear_attention" for kind in types], moe


def _values(hf: dict) -> dict:
    """Experts routed by a softmax, renormalized over the top k with norm_topk_prob; Qwen3.5's always
    renormalized, and qwen3_5_moe_text has no dense MLP size."""
    if hf["model_type"] == "qwen3_5_moe_text":
        hf = {**hf, "intermediate_size": hf.get("intermediate_size") or required(hf, "moe_intermediate_size"),
              "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}
    elif hf["model_type"] == "qwen3_5_text":
        hf = {**hf, "num_experts": None}
    linear, moe = _layers(hf)
    parameters = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    values = {**llama_values(hf), "qk_layernorm": True, "attention_output_gate": True, "apply_layernorm_1p": True,
              "rotary_percent": float(parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
              "experimental_attention_variant": "gated_delta_net",
              "linear_attention_freq": layer_list_expression(linear),
              **{key: required(hf, key) for key in _LINEAR_ATTENTION_KEYS}}
    if any(moe):
        values.update(num_experts=required(hf, "num_experts"), moe_router_topk=required(hf, "num_experts_per_tok"),
                      moe_ffn_hidden_size=required(hf, "moe_intermediate_size"),
                      moe_layer_freq=layer_list_expression(moe),
                      moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
                      moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
                      moe_shared_expert_intermediate_size=required(hf, "shared_expert_intermediate_size"),
                      moe_shared_expert_gate=True)
    return values


def _recognises(m: ModelConfig) -> bool:
    """A network with Gated DeltaNet layers is Qwen3-Next's or no family's."""
    if m.experimental_attention_variant is None:
        return False
    needs = [(not gpt_oss_options(m), f"none of {', '.join(gpt_oss_options(m))}"),
             (m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope"
              and m.disable_bias_linear and not m.add_qkv_bias, "RMSNorm, SwiGLU, RoPE and no biases"),
             (m.qk_layernorm and m.attention_output_gate and m.apply_layernorm_1p and not m.multi_latent_attention,
              "--qk-layernorm, --attention-output-gate and --apply-layernorm-1p"),
             (not m.use_rope_scaling, "plain RoPE (no --use-rope-scaling)")]
    if m.num_experts:
        needs += [(m.moe_router_score_function == "softmax" and not m.moe_router_enable_expert_bias
                   and m.moe_router_num_groups is None and m.moe_router_topk_scaling_factor is None,
                   "softmax routing without expert bias, groups or scaling"),
                  (bool(m.moe_shared_expert_intermediate_size) and m.moe_shared_expert_gate,
                   "a gated shared expert (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate)")]
    refuse_network("qwen3_next", "Gated DeltaNet layers", needs)
    return True


def _hybrid_config(m: ModelConfig, model_type: str, architecture: str) -> dict:
    """What Qwen3-Next's and Qwen3.5's config.json share: a Llama's keys, partial RoPE, each layer's kind and the
    Gated DeltaNet shapes."""
    config = llama_config(m)
    del config["mlp_bias"]
    return {**config, "architectures": [architecture], "model_type": model_type,
            "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": m.rotary_percent},
            "layer_types": ["linear_attention" if linear else "full_attention"
                            for linear in linear_attention_pattern(m)],
            **{key: getattr(m, key) for key in _LINEAR_ATTENTION_KEYS}}


def _qwen3_next_config(m: ModelConfig) -> dict:
    moe = moe_layer_pattern(m)
    return {**_hybrid_config(m, "qwen3_next", "Qwen3NextForCausalLM"), "partial_rotary_factor": m.rotary_percent,
            "num_experts": m.num_experts or 0, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size or 0,
            "norm_topk_prob": not m.moe_router_pre_softmax, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i, is_moe in enumerate(moe) if not is_moe]}


def _qwen3_5_moe_config(m: ModelConfig) -> dict:
    config = _hybrid_config(m, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
    del config["intermediate_size"]
    return {**config, "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
            "router_aux_loss_coef": m.moe_aux_loss_coeff}


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


# Qwen3-Next's in_proj_qkvz (per key head [q, k, v, z]) and in_proj_ba (per key head [b, a]) -> our in_proj
GDN_PROJECTION = Transform(_per_key_head, lambda t, m: _from_key_heads(t, _projection_rows(m), m))
# Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a -> our in_proj
GDN_SEPARATE_PROJECTIONS = Transform(_separate_projections_to_ours, _ours_to_separate_projections)
# The convolution's conv1d ([q; k; v] channels, each over all key heads) -> ours, per key head [q, k, v]
GDN_CONV = Transform(lambda hf, m: _per_key_head(_split_qkv_channels(hf[0], m), m),
                     lambda t, m: [torch.cat(_from_key_heads(t, _conv_rows(m), m))])


def _gated_delta_net(m: ModelConfig, separate_projections: bool) -> list[Rule]:
    """Qwen3-Next's (or, with `separate_projections`, Qwen3.5's) linear_attn (Gated DeltaNet) -> ours
    (model/linear_attention/gated_delta_net.py)."""
    ours, theirs = "decoder.layers.{layer}.self_attention.", "model.layers.{layer}.linear_attn."
    keys = m.linear_num_key_heads * m.linear_key_head_dim
    values = m.linear_num_value_heads * m.linear_value_head_dim
    heads, h = m.linear_num_value_heads, m.hidden_size
    if separate_projections:
        projection = Rule(ours + "in_proj.weight", tuple(f"{theirs}in_proj_{part}.weight" for part in
                                                         ("qkv", "z", "b", "a")),
                          lambda m: ((2 * keys + values, h), (values, h), (heads, h), (heads, h)),
                          GDN_SEPARATE_PROJECTIONS)
    else:
        projection = Rule(ours + "in_proj.weight", (theirs + "in_proj_qkvz.weight", theirs + "in_proj_ba.weight"),
                          lambda m: ((2 * keys + 2 * values, h), (2 * heads, h)), GDN_PROJECTION)
    return [projection,
            Rule(ours + "conv1d_weight", (theirs + "conv1d.weight",),
                 lambda m: ((2 * keys + values, 1, m.linear_conv_kernel_dim),), GDN_CONV),
            Rule(ours + "A_log", (theirs + "A_log",), lambda m: ((heads,),)),
            Rule(ours + "dt_bias", (theirs + "dt_bias",), lambda m: ((heads,),)),
            Rule(ours + "norm_weight", (theirs + "norm.weight",), lambda m: ((m.linear_value_head_dim,),)),
            Rule(ours + "out_proj.weight", (theirs + "out_proj.weight",), lambda m: ((h, values),))]


def _name_table(m: ModelConfig, separate_projections: bool = False) -> NameTable:
    """Gated DeltaNet layers (their norms a Llama layer's) between softmax-attention layers (Qwen3's attention with
    an output gate in q_proj), each with Qwen2-MoE's experts or a dense SwiGLU MLP."""
    attention = llama_attention(m)
    linear = attention[:2] + _gated_delta_net(m, separate_projections)  # input and post-attention norms, then ours
    dense = swiglu_mlp("decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp.", lambda m: m.ffn_hidden_size)
    moe = qwen_moe_mlp(m) if m.num_experts else dense
    return llama_names(m, lambda spec: ((linear if spec.mixer == GATED_DELTA_NET else attention)
                                        + (moe if spec.routed_experts else dense)))


def _name_table_qwen3_5(m: ModelConfig) -> NameTable:
    return _name_table(m, separate_projections=True)


QWEN3_NEXT = Family("qwen3_next", _values, _qwen3_next_config, _recognises, _name_table)
# Qwen3-Next's network, so chosen only for a checkpoint converted from Qwen3.5: dense, or with experts in every layer
# renormalized over the top k
QWEN3_5_TEXT = Family("qwen3_5_text", _values, lambda m: _hybrid_config(m, "qwen3_5_text", "Qwen3_5ForCausalLM"),
                      lambda m: _recognises(m) and not m.num_experts, _name_table_qwen3_5, detected=False,
                      language_model_of="qwen3_5")
QWEN3_5_MOE_TEXT = Family("qwen3_5_moe_text", _values, _qwen3_5_moe_config,
                          lambda m: (_recognises(m) and bool(m.num_experts) and all(moe_layer_pattern(m))
                                     and not m.moe_router_pre_softmax),
                          _name_table_qwen3_5, detected=False, language_model_of="qwen3_5_moe")
