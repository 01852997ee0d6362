"""gpt-oss (transformers' gpt_oss): its config.json <-> megatron_lite model flags, the network it recognises and its
name table.

gpt-oss is a Llama-shaped MoE with biases in every linear (attention, router, experts; Megatron's
add_bias_linear), a learned attention sink per head (--softmax-type learnable), sliding-window attention on the
layers `layer_types` marks "sliding_attention" (--window-size W-1 0, transformers' `sliding_window` W counting
the query itself; --window-attn-skip-freq lists the layers), YaRN on the rotary embeddings without rounding its
band (--position-embedding-type yarn --no-yarn-correction-range-round-to-int), experts routed by a softmax over
the top-k logits, and a clamped gated unit: (clamp(up) + 1) x gate sigmoid(1.702 gate) with the gate clamped
from above (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value swiglu_limit). Its experts are
stored stacked per layer, gate and up interleaved in gate_up_proj, weights as [in, out].
"""

from __future__ import annotations

import torch

from megatron_lite.config.layer_pattern import layer_list_expression, moe_layer_pattern, window_attention_pattern
from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import ConversionError, refuse, required
from megatron_lite.hf.families.family import Family, refuse_network
from megatron_lite.hf.llama_config import llama_config, llama_values, yarn_values
from megatron_lite.hf.name_tables import SAME, NameTable, Rule, Transform, llama_attention, llama_names, transposed

QUICK_GELU_ALPHA = 1.702  # the gate's sigmoid slope of --quick-geglu


def _values(hf: dict) -> dict:
    quantization = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization is not None:
        raise ConversionError(f"config.json's experts are quantized ({quantization}); dequantize the checkpoint to "
                              f"bf16 first (transformers: from_pretrained with Mxfp4Config(dequantize=True), then "
                              f"save_pretrained)")
    refuse(not hf.get("attention_bias", True), "a gpt_oss without attention biases")
    refuse(float(hf.get("swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA,
           f"a swiglu_alpha ({hf.get('swiglu_alpha')}) other than {QUICK_GELU_ALPHA}")
    layers = required(hf, "num_hidden_layers")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    refuse(len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"},
           f"layer_types {types!r}")
    values = {**llama_values({**hf, "attention_bias": False, "rope_parameters": None, "rope_scaling": None}),
              **yarn_values(hf)}
    if "rotary_scaling_factor" in values:
        values["position_embedding_type"] = "yarn"
    values.update(swiglu=False, quick_geglu=True, glu_linear_offset=1.0,
                  activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)), disable_bias_linear=False,
                  softmax_type="learnable", num_experts=required(hf, "num_local_experts"),
                  moe_router_topk=required(hf, "num_experts_per_tok"),
                  moe_ffn_hidden_size=required(hf, "intermediate_size"),
                  moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    windowed = [kind == "sliding_attention" for kind in types]
    if any(windowed):
        values["window_size"] = [required(hf, "sliding_window") - 1, 0]
        if not all(windowed):
            values["window_attn_skip_freq"] = layer_list_expression(windowed)
    return values


def gpt_oss_options(m: ModelConfig) -> list[str]:
    """The gpt-oss options the model sets, which no other family converted here has."""
    options = [("--window-size", m.window_size is not None), ("--softmax-type", m.softmax_type != "vanilla"),
               ("--quick-geglu", m.quick_geglu), ("--glu-linear-offset", bool(m.glu_linear_offset)),
               ("--activation-func-clamp-value", m.activation_func_clamp_value is not None)]
    return [flag for flag, given in options if given]


def _recognises(m: ModelConfig) -> bool:
    """A network with gpt-oss's options or YaRN on plain attention is gpt-oss's or no family's."""
    if not (gpt_oss_options(m) or m.position_embedding_type == "yarn"):
        return False
    refuse_network("gpt_oss", ", ".join(gpt_oss_options(m)) or "YaRN", [
        (m.normalization == "RMSNorm" and m.quick_geglu and m.glu_linear_offset == 1.0
         and m.activation_func_clamp_value is not None, "RMSNorm and --quick-geglu with --glu-linear-offset 1 "
                                                        "and --activation-func-clamp-value"),
        (not m.disable_bias_linear and m.softmax_type == "learnable", "biases (no --disable-bias-linear) and "
                                                                       "--softmax-type learnable"),
        (m.rotary_position_embeddings and not m.use_rope_scaling and m.rotary_percent == 1,
         "RoPE or YaRN over whole heads"),
        (not (m.qk_layernorm or m.attention_output_gate or m.apply_layernorm_1p or m.multi_latent_attention
              or m.experimental_attention_variant), "plain softmax attention and norms"),
        (bool(m.num_experts) and all(moe_layer_pattern(m)) and m.moe_router_score_function == "softmax"
         and not (m.moe_router_pre_softmax or m.moe_router_enable_expert_bias)
         and not m.moe_shared_expert_intermediate_size and m.moe_router_num_groups is None
         and m.moe_router_topk_scaling_factor is None,
         "experts in every layer routed by a softmax over the top-k logits, without a shared expert")])
    return True


def _rope_parameters(m: ModelConfig) -> dict:
    if m.position_embedding_type == "rope":
        return {"rope_type": "default", "rope_theta": m.rotary_base}
    rope = {"rope_type": "yarn", "rope_theta": m.rotary_base, "factor": m.rotary_scaling_factor,
            "original_max_position_embeddings": m.yarn_original_max_position_embeddings,
            "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow,
            "truncate": m.yarn_correction_range_round_to_int}
    if m.mscale_all_dim:
        rope.update(mscale=m.mscale, mscale_all_dim=m.mscale_all_dim)
    return rope


def _config(m: ModelConfig) -> dict:
    config = llama_config(m)
    del config["mlp_bias"]
    windowed = window_attention_pattern(m)
    return {**config, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
            "rope_parameters": _rope_parameters(m), "rope_scaling": None,
            "intermediate_size": m.moe_ffn_hidden_size, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": m.activation_func_clamp_value,
            "sliding_window": m.window_size[0] + 1 if m.window_size else None,
            "layer_types": ["sliding_attention" if flag else "full_attention" for flag in windowed]}


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


def _name_table(m: ModelConfig) -> NameTable:
    """Llama's attention with biases on q, k, v and o and a learned sink per head; a router with a bias; experts
    stored stacked per layer (`stacked_experts`)."""
    ours, attn, moe = "decoder.layers.{layer}.", "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
    expert = ours + "mlp.experts.{expert}."
    ffn = m.moe_ffn_hidden_size
    layer = llama_attention(m) + [
        Rule(ours + "self_attention.sinks", (attn + "sinks",), lambda m: ((m.num_attention_heads,),)),
        Rule(ours + "mlp.router.weight", (moe + "router.weight",), lambda m: ((m.num_experts, m.hidden_size),)),
        Rule(ours + "mlp.router.bias", (moe + "router.bias",), lambda m: ((m.num_experts,),)),
        Rule(expert + "linear_fc1.weight", (moe + "experts.gate_up_proj",),
             lambda m: ((m.num_experts, m.hidden_size, 2 * ffn),), INTERLEAVED_GATE_UP, stacked_experts=True),
        Rule(expert + "linear_fc1.bias", (moe + "experts.gate_up_proj_bias",), lambda m: ((m.num_experts, 2 * ffn),),
             INTERLEAVED_GATE_UP_BIAS, stacked_experts=True),
        Rule(expert + "linear_fc2.weight", (moe + "experts.down_proj",),
             lambda m: ((m.num_experts, ffn, m.hidden_size),), transposed(SAME), stacked_experts=True),
        Rule(expert + "linear_fc2.bias", (moe + "experts.down_proj_bias",), lambda m: ((m.num_experts, m.hidden_size),),
             stacked_experts=True)]
    return llama_names(m, lambda spec: layer)


GPT_OSS = Family("gpt_oss", _values, _config, _recognises, _name_table)
