"""gpt-oss's config.json <-> megatron_lite model flags (transformers' gpt_oss).

gpt-oss is a Llama-shaped MoE with biases in every linear (attention, router, experts; Megatron's
add_bias_linear), a learned attention sink per head (--softmax-type learnable), sliding-window attention on the
layers `layer_types` marks "sliding_attention" (--window-size W-1 0, transformers' `sliding_window` W counting
the query itself; --window-attn-skip-freq lists the layers), YaRN on the rotary embeddings without rounding its
band (--position-embedding-type yarn --no-yarn-correction-range-round-to-int), experts routed by a softmax over
the top-k logits, and a clamped gated unit: (clamp(up) + 1) x gate sigmoid(1.702 gate) with the gate clamped
from above (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value swiglu_limit).
"""

from __future__ import annotations

from megatron_lite.config.layer_pattern import layer_list_expression, moe_layer_pattern, window_attention_pattern
from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.llama_config import ConversionError, llama_config, llama_values, refuse, required, yarn_values

QUICK_GELU_ALPHA = 1.702  # the gate's sigmoid slope of --quick-geglu


def gpt_oss_values(hf: dict) -> dict:
    """config.json of model_type gpt_oss -> values of pretrain_gpt.py's model flags."""
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


def gpt_oss_refusal(m: ModelConfig) -> str | None:
    """What a model lacks to be a gpt-oss, or None."""
    needs = [(m.normalization == "RMSNorm" and m.quick_geglu and m.glu_linear_offset == 1.0
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
              "experts in every layer routed by a softmax over the top-k logits, without a shared expert")]
    missing = [what for ok, what in needs if not ok]
    return ", ".join(missing) if missing else None


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


def gpt_oss_config(m: ModelConfig) -> dict:
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
