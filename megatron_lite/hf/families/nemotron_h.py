"""Nemotron-H and Nemotron 3 (transformers' nemotron_h): their config.json <-> megatron_lite model flags, the network
they recognise and their name table.

Every block of a Nemotron-H is one sublayer with its own RMSNorm and residual, its kind one symbol of
hybrid_override_pattern (or one entry of layers_block_type): Mamba-2 mixers (M), attention without positional
embeddings (*), squared-ReLU MLPs (-) and MoE layers (E: sigmoid-routed squared-ReLU experts with an expert bias,
renormalized over the top k and scaled by routed_scaling_factor, and a shared expert; with moe_latent_size, as in
Nemotron 3 Super, the routed experts work in a latent the tokens are projected to and back from). The pattern becomes
--hybrid-layer-pattern as it is: a mixer and the MLP after it are one of our layers (a Mamba-2 mixer with no MLP
after it one alone), whose parts the name table finds in the blocks they are stored as (`{mixer}`, `{mlp}`). A
Mamba-2 mixer's projection and convolution are laid out per group here (model/mamba/mixer.py), by HF over all
groups part by part ([z, x, B, C, dt] and [x, B, C]).

Nemotron 3 Super's files also hold num_nextn_predict_layers multi-token prediction depths, each the blocks of
mtp_hybrid_override_pattern (transformers 5 writes it as mtp_layers_block_type): the pattern's `/` depths here. HF
numbers the blocks of all depths on from 0 under mtp.layers; a depth's first block also holds its enorm, hnorm and
eh_proj, its last its final norm (Megatron-Bridge's names). transformers builds no such depth and leaves those
tensors out when it loads a checkpoint, so a file it saved holds none.

Refused with one line: biases, time-step limits, residuals kept in fp32, and the other activations and kernel
sizes.
"""

from __future__ import annotations

import math

import torch

from megatron_lite.config.hybrid_layer_pattern import parse_hybrid_layer_pattern
from megatron_lite.config.layer_specs import ATTENTION, MAMBA, NO_MLP
from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse, required
from megatron_lite.hf.families.family import Family, refuse_network
from megatron_lite.hf.name_tables import QKV, VOCAB_ROWS, NameTable, Rule, Transform, output_layer

_BLOCK_TYPES = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
                "moe": "E"}


def _symbols(hf: dict, pattern_key: str, types_key: str, default: list[str] | None = None) -> str:
    """A pattern of blocks (`pattern_key`), or the symbols of its list of block types (`types_key`, transformers 5's
    form of it; `default` where there is neither)."""
    if hf.get(pattern_key):
        return hf[pattern_key]
    types = hf.get(types_key) or default or required(hf, types_key)
    refuse(not set(types) <= set(_BLOCK_TYPES), f"{types_key} {types!r}")
    return "".join(_BLOCK_TYPES[kind] for kind in types)


def _pattern(hf: dict) -> str:
    """hybrid_override_pattern, then after a / for each multi-token prediction depth its blocks
    (mtp_hybrid_override_pattern; without it, transformers' default, an attention and an MoE block)."""
    pattern = _symbols(hf, "hybrid_override_pattern", "layers_block_type")
    depths = hf.get("num_nextn_predict_layers") or 0
    if depths:
        depth = _symbols(hf, "mtp_hybrid_override_pattern", "mtp_layers_block_type", ["full_attention", "moe"])
        pattern += f"/{depth}" * depths
    return pattern


def refuse_other_mixers(hf: dict, activation_key: str) -> None:
    """One line for a Mamba-2 mixer this version does not build (Nemotron-H's and Mamba-2's keys): a convolution
    without a bias or of another width, an activation other than SiLU (`activation_key`), a time-step limit."""
    model_type = hf.get("model_type")
    refuse(not hf.get("use_conv_bias", True), f"a {model_type} convolution without a bias")
    refuse(hf.get(activation_key, "silu") != "silu", f"{activation_key} {hf.get(activation_key)!r}")
    refuse(hf.get("conv_kernel", 4) != 4, f"conv_kernel {hf.get('conv_kernel')} (this version builds 4)")
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    refuse(tuple(float(x) if not isinstance(x, dict) else math.inf for x in limit) != (0.0, math.inf),
           f"time_step_limit {limit!r}")


def _values(hf: dict) -> dict:
    refuse(any(hf.get(key) for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias")),
           "a nemotron_h with biases")
    refuse(hf.get("mlp_hidden_act", "relu2") != "relu2", f"mlp_hidden_act {hf.get('mlp_hidden_act')!r}")
    refuse_other_mixers(hf, "mamba_hidden_act")
    refuse(bool(hf.get("residual_in_fp32")), "residual_in_fp32")
    pattern = _pattern(hf)
    values = {"hybrid_layer_pattern": pattern, "hidden_size": required(hf, "hidden_size"),
              "vocab_size": required(hf, "vocab_size"), "normalization": "RMSNorm",
              "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)), "swiglu": False, "squared_relu": True,
              "position_embedding_type": "none", "disable_bias_linear": True,
              "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
              "max_position_embeddings": hf.get("max_position_embeddings", 4096),
              "num_attention_heads": required(hf, "num_attention_heads"), "group_query_attention": True,
              "num_query_groups": required(hf, "num_key_value_heads"), "kv_channels": required(hf, "head_dim"),
              "ffn_hidden_size": required(hf, "intermediate_size"), "mamba_num_heads": required(hf, "mamba_num_heads"),
              "mamba_head_dim": required(hf, "mamba_head_dim"), "mamba_state_dim": required(hf, "ssm_state_size"),
              "mamba_num_groups": required(hf, "n_groups"), "hidden_dropout": 0.0, "attention_dropout": 0.0}
    if "E" in pattern:
        refuse(not hf.get("norm_topk_prob", True), "a nemotron_h without norm_topk_prob")
        refuse(hf.get("n_shared_experts", 1) != 1, f"n_shared_experts {hf.get('n_shared_experts')}")
        groups, topk = hf.get("n_group") or 1, required(hf, "num_experts_per_tok")
        values.update(num_experts=required(hf, "n_routed_experts"), moe_router_topk=topk,
                      moe_ffn_hidden_size=required(hf, "moe_intermediate_size"),
                      moe_shared_expert_intermediate_size=required(hf, "moe_shared_expert_intermediate_size"),
                      moe_latent_size=hf.get("moe_latent_size"),
                      moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                      moe_router_num_groups=groups if groups > 1 else None,
                      moe_router_group_topk=hf.get("topk_group") if groups > 1 else None)
    return values


def _recognises(m: ModelConfig) -> bool:
    """A network with Mamba-2 layers, or squared-ReLU MLPs without positional embeddings, is Nemotron-H's or no
    family's."""
    if "M" not in (m.hybrid_layer_pattern or "") and not m.squared_relu:
        return False
    needs = [(m.hybrid_layer_pattern is not None and set(m.hybrid_layer_pattern) <= set("M*-E|/"),
              "--hybrid-layer-pattern (its blocks) of M, *, - and E"),
             (m.normalization == "RMSNorm" and m.squared_relu and m.position_embedding_type == "none"
              and m.disable_bias_linear, "RMSNorm, --squared-relu, --position-embedding-type none and no biases"),
             (not (m.qk_layernorm or m.attention_output_gate or m.apply_layernorm_1p or m.multi_latent_attention
                   or m.experimental_attention_variant or m.window_size or m.softmax_type != "vanilla"
                   or m.add_qkv_bias), "plain grouped-query attention")]
    if m.num_experts:
        needs.append((m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias
                      and bool(m.moe_shared_expert_intermediate_size) and not m.moe_shared_expert_gate,
                      "sigmoid routing with an expert bias and an ungated shared expert"))
    refuse_network("nemotron_h", "Mamba-2 layers or squared-ReLU MLPs", needs)
    return True


def _config(m: ModelConfig) -> dict:
    pattern, *depths = m.hybrid_layer_pattern.replace("|", "").split("/")
    config = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": m.hidden_size,
              "vocab_size": m.vocab_size, "hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern),
              "layer_norm_epsilon": m.norm_epsilon, "num_attention_heads": m.num_attention_heads,
              "num_key_value_heads": m.num_query_groups, "head_dim": m.head_dim,
              "intermediate_size": m.ffn_hidden_size, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu",
              "mamba_num_heads": m.mamba_num_heads or 2 * m.hidden_size // m.mamba_head_dim,
              "mamba_head_dim": m.mamba_head_dim, "ssm_state_size": m.mamba_state_dim, "n_groups": m.mamba_num_groups,
              "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": True, "use_bias": False, "mlp_bias": False,
              "attention_bias": False, "residual_in_fp32": False, "max_position_embeddings": m.max_position_embeddings,
              "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
              "num_nextn_predict_layers": len(depths)}
    if depths:
        config["mtp_hybrid_override_pattern"] = depths[0]
    if m.num_experts:
        config.update(n_routed_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                      moe_intermediate_size=m.moe_ffn_hidden_size,
                      moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, n_shared_experts=1,
                      routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0, norm_topk_prob=True,
                      n_group=m.moe_router_num_groups or 1, topk_group=m.moe_router_group_topk or 1,
                      moe_latent_size=m.moe_latent_size)
    return config


def _by_group(m: ModelConfig, per_group: list[int], groups: int) -> Transform:
    """HF's parts, each over all groups in order, <-> ours, every part of group 0, then of group 1, ...;
    `per_group` the rows each part has per group."""
    def to_ours(hf: list[torch.Tensor], m: ModelConfig) -> torch.Tensor:
        parts = hf[0].split([rows * groups for rows in per_group])
        return torch.cat([part.reshape(groups, -1, *part.shape[1:]) for part in parts], dim=1).flatten(0, 1)

    def to_hf(t: torch.Tensor, m: ModelConfig) -> list[torch.Tensor]:
        parts = t.reshape(groups, -1, *t.shape[1:]).split(per_group, dim=1)
        return [torch.cat([part.flatten(0, 1) for part in parts])]

    return Transform(to_ours, to_hf)


# Where HF stores the blocks of the decoder and those of the multi-token prediction depths
DECODER, DEPTHS = "backbone.layers.", "mtp.layers."


def mamba_rules(m: ModelConfig, stored: str = DECODER) -> list[Rule]:
    """A Mamba-2 mixer (model/mamba/mixer.py) stored as block `{mixer}` under `stored`: its projection and
    convolution by group (Nemotron-H's and Mamba-2's names)."""
    ours, theirs = "decoder.layers.{layer}.self_attention.", stored + "{mixer}.mixer."
    heads = m.mamba_num_heads or 2 * m.hidden_size // m.mamba_head_dim
    groups, h = m.mamba_num_groups, m.hidden_size
    per_head = heads // groups * m.mamba_head_dim
    inner, state = heads * m.mamba_head_dim, m.mamba_state_dim
    channels = inner + 2 * groups * state
    projection = _by_group(m, [per_head, per_head, state, state, heads // groups], groups)
    convolution = _by_group(m, [per_head, state, state], groups)
    return [Rule(ours + "in_proj.weight", (theirs + "in_proj.weight",),
                 lambda m: ((2 * inner + 2 * groups * state + heads, h),), projection),
            Rule(ours + "conv1d_weight", (theirs + "conv1d.weight",), lambda m: ((channels, 1, 4),), convolution),
            Rule(ours + "conv1d_bias", (theirs + "conv1d.bias",), lambda m: ((channels,),), convolution),
            *[Rule(ours + name, (theirs + name,), lambda m: ((heads,),)) for name in ("A_log", "D", "dt_bias")],
            Rule(ours + "norm_weight", (theirs + "norm.weight",), lambda m: ((inner,),)),
            Rule(ours + "out_proj.weight", (theirs + "out_proj.weight",), lambda m: ((h, inner),))]


def _attention(m: ModelConfig, stored: str) -> list[Rule]:
    ours, theirs = "decoder.layers.{layer}.self_attention.", stored + "{mixer}.mixer."
    q, kv, h = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim, m.hidden_size
    return [Rule(ours + "linear_qkv.weight", tuple(f"{theirs}{p}_proj.weight" for p in "qkv"),
                 lambda m: ((q, h), (kv, h), (kv, h)), QKV),
            Rule(ours + "linear_proj.weight", (theirs + "o_proj.weight",), lambda m: ((h, q),))]


def _up_down(ours: str, theirs: str, ffn: int, h: int) -> list[Rule]:
    """A squared-ReLU MLP: HF's up and down projections -> our fc1 and fc2."""
    return [Rule(ours + "linear_fc1.weight", (theirs + "up_proj.weight",), lambda m: ((ffn, h),)),
            Rule(ours + "linear_fc2.weight", (theirs + "down_proj.weight",), lambda m: ((h, ffn),))]


def _mlp(m: ModelConfig, routed: bool, stored: str) -> list[Rule]:
    ours, theirs, h = "decoder.layers.{layer}.mlp.", stored + "{mlp}.mixer.", m.hidden_size
    if not routed:
        return _up_down(ours, theirs, m.ffn_hidden_size, h)
    latent = m.moe_latent_size
    projections = [] if latent is None else [
        Rule(ours + "fc1_latent_proj", (theirs + "fc1_latent_proj.weight",), lambda m: ((latent, h),)),
        Rule(ours + "fc2_latent_proj", (theirs + "fc2_latent_proj.weight",), lambda m: ((h, latent),))]
    return [Rule(ours + "router.weight", (theirs + "gate.weight",), lambda m: ((m.num_experts, h),)),
            Rule(ours + "router.expert_bias", (theirs + "gate.e_score_correction_bias",),
                 lambda m: ((m.num_experts,),)),
            *projections,
            *_up_down(ours + "experts.{expert}.", theirs + "experts.{expert}.", m.moe_ffn_hidden_size, latent or h),
            *_up_down(ours + "shared_experts.", theirs + "shared_experts.", m.moe_shared_expert_intermediate_size, h)]


def _numbered(layers, start: int) -> list[dict]:
    """Each layer's blocks, numbered on from `start`: its mixer's, and its MLP's after it."""
    blocks = []
    for layer in layers:
        blocks.append({"mixer": start, "mlp": start + 1})
        start += 1 + (layer.mlp is not None)
    return blocks


def stored_blocks(m: ModelConfig):
    """Our layer i -> the HF blocks its mixer and MLP are stored as (each sublayer its own block): a decoder
    layer's under backbone.layers, a multi-token prediction layer's under mtp.layers, numbered on from the first
    depth's, with its depth's first and last block (`first`, `last`)."""
    pattern = parse_hybrid_layer_pattern(m.hybrid_layer_pattern)
    blocks = _numbered(pattern.layers, 0)
    per_depth = sum(1 + (layer.mlp is not None) for layer in pattern.depths[0]) if pattern.depths else 0
    for index, depth in enumerate(pattern.depths):
        first = index * per_depth
        blocks += [{**numbered, "first": first, "last": first + per_depth - 1}
                   for numbered in _numbered(depth, first)]
    return lambda layer: blocks[layer]


def _mtp(m: ModelConfig) -> list[Rule]:
    """A multi-token prediction depth's own tensors: enorm, hnorm and the 2h -> h eh_proj on its first block, the
    final norm on its last (Megatron-Bridge's names; the layouts are ours, model/mtp.py)."""
    h = m.hidden_size
    ours, first, last = "mtp.layers.{depth}.", DEPTHS + "{first}.", DEPTHS + "{last}."
    return [Rule(ours + "enorm.weight", (first + "enorm.weight",), lambda m: ((h,),)),
            Rule(ours + "hnorm.weight", (first + "hnorm.weight",), lambda m: ((h,),)),
            Rule(ours + "eh_proj.weight", (first + "eh_proj.weight",), lambda m: ((h, 2 * h),)),
            Rule(ours + "final_layernorm.weight", (last + "final_layernorm.weight",), lambda m: ((h,),))]


def _name_table(m: ModelConfig) -> NameTable:
    h = m.hidden_size
    mixers = {stored: {MAMBA: mamba_rules(m, stored), ATTENTION: _attention(m, stored)} for stored in (DECODER, DEPTHS)}

    def layer(spec, stored: str = DECODER) -> list[Rule]:
        norm = stored + "{%s}.norm.weight"
        mixer_norm = Rule("decoder.layers.{layer}.input_layernorm.weight", (norm % "mixer",), lambda m: ((h,),))
        if spec.mlp == NO_MLP:
            return [mixer_norm, *mixers[stored][spec.mixer]]
        mlp_norm = Rule("decoder.layers.{layer}.pre_mlp_layernorm.weight", (norm % "mlp",), lambda m: ((h,),))
        return [mixer_norm, *mixers[stored][spec.mixer], mlp_norm, *_mlp(m, spec.routed_experts, stored)]

    return NameTable(
        head=[Rule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",), lambda m: ((m.vocab_size, h),),
                   VOCAB_ROWS)],
        layer=layer,
        tail=[Rule("decoder.final_layernorm.weight", ("backbone.norm_f.weight",), lambda m: ((h,),)),
              *output_layer(m, "lm_head.weight")],
        mtp=_mtp(m),
        blocks=stored_blocks(m),
        mtp_layer=lambda spec: layer(spec, DEPTHS))


NEMOTRON_H = Family("nemotron_h", _values, _config, _recognises, _name_table)
