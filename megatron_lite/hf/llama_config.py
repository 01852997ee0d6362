"""What the config.json of every Llama-derived family shares, read and written: sizes, norms and RoPE (plain, Llama
3.1's scaling or YaRN). The families' modules (families/) build on it."""

from __future__ import annotations

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import ConversionError, refuse, required
from megatron_lite.model.attention.yarn import YarnScaling

# rope_type "llama3" keys -> our flags
LLAMA3_ROPE_FLAGS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
                      "high_freq_factor": "rope_scaling_high_freq_factor",
                      "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}


def _rope_values(hf: dict) -> dict:
    """--rotary-base and Llama 3.1's scaling from transformers 5's `rope_parameters` or the older `rope_theta` and
    `rope_scaling` keys (`rope_scaling` wins where both are given); plain RoPE or rope_type "llama3" only."""
    parameters = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    refuse(rope_type not in ("default", "llama3"), f"RoPE scaling ({rope_type})")
    values = {"rotary_base": float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "llama3":
        missing = [key for key in LLAMA3_ROPE_FLAGS if key not in parameters]
        if missing:
            raise ConversionError(f"config.json's llama3 RoPE scaling has no {', '.join(missing)}")
        values.update({flag: parameters[key] for key, flag in LLAMA3_ROPE_FLAGS.items()}, use_rope_scaling=True)
    return values


def llama_values(hf: dict) -> dict:
    hidden, heads = required(hf, "hidden_size"), required(hf, "num_attention_heads")
    head_dim = hf.get("head_dim") or hidden // heads
    refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
    refuse(bool(hf.get("attention_bias") or hf.get("mlp_bias")),
            f"a {hf.get('model_type')} with attention or MLP biases")
    positions = required(hf, "max_position_embeddings")
    return {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
            "disable_bias_linear": True, "group_query_attention": True,
            "num_layers": required(hf, "num_hidden_layers"), "hidden_size": hidden,
            "ffn_hidden_size": required(hf, "intermediate_size"), "num_attention_heads": heads,
            "num_query_groups": hf.get("num_key_value_heads") or heads,
            "kv_channels": head_dim if head_dim != hidden // heads else None, "seq_length": positions,
            "max_position_embeddings": positions, "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
            **_rope_values(hf), "vocab_size": required(hf, "vocab_size"),
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", False),
            "init_method_std": float(hf.get("initializer_range", 0.02)), "hidden_dropout": 0.0,
            "attention_dropout": float(hf.get("attention_dropout", 0.0))}


# rope_type "yarn" keys (DeepSeek-V3, gpt-oss) -> our flags (beta_fast/slow default to 32 and 1 in both)
YARN_FLAGS = {"factor": "rotary_scaling_factor", "original_max_position_embeddings":
              "yarn_original_max_position_embeddings", "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow"}


def yarn_values(hf: dict) -> dict:
    """--rotary-base and YaRN's flags from the RoPE parameters of DeepSeek-V3 or gpt-oss (plain RoPE or rope_type
    "yarn"; `truncate: false` is --no-yarn-correction-range-round-to-int).

    transformers scales cos and sin by `attention_factor`, or without it by mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are set and mscale(factor, 1) otherwise; its softmax scale takes
    mscale(factor, mscale_all_dim)^2 (model/attention/yarn.py). The flags are chosen to give both."""
    parameters = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    refuse(rope_type not in ("default", "yarn"), f"RoPE scaling ({rope_type}) in a {hf.get('model_type')}")
    values = {"rotary_base": float(parameters.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return values
    for key in ("factor", "original_max_position_embeddings"):
        required(parameters, key)
    values["yarn_correction_range_round_to_int"] = parameters.get("truncate", True) is not False
    values.update({flag: parameters[key] for key, flag in YARN_FLAGS.items() if parameters.get(key) is not None})
    mscale, all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim") or 0.0
    refuse(bool(all_dim) and not mscale and parameters.get("attention_factor") is None,
           "YaRN's mscale_all_dim without mscale")
    values.update(mscale=float(mscale) if mscale and all_dim else 1.0, mscale_all_dim=float(all_dim))
    given = parameters.get("attention_factor")
    if given is not None:
        ours = YarnScaling(values["rotary_scaling_factor"], 1, 32.0, 1.0, values["mscale"], values["mscale_all_dim"],
                           1.0).attention_factor
        refuse(abs(given - ours) > 1e-12 * abs(ours), f"a YaRN attention_factor ({given}) other than the "
                                                       f"mscale ratio ({ours})")
    return values


def llama_config(m: ModelConfig) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
            "head_dim": m.head_dim, "hidden_act": "silu", "max_position_embeddings": m.max_position_embeddings,
            "rms_norm_eps": m.norm_epsilon, "rope_theta": m.rotary_base, **_rope_config(m),
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_bias": False,
            "mlp_bias": False, "attention_dropout": m.attention_dropout, "initializer_range": m.init_method_std}


def _rope_config(m: ModelConfig) -> dict:
    """`rope_parameters` (transformers 5) and `rope_scaling` (older versions) of the model's RoPE."""
    if not m.use_rope_scaling:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": m.rotary_base}, "rope_scaling": None}
    scaling = {"rope_type": "llama3", "factor": m.rope_scaling_factor,
               "low_freq_factor": m.rope_scaling_low_freq_factor, "high_freq_factor": m.rope_scaling_high_freq_factor,
               "original_max_position_embeddings": m.rope_scaling_original_max_position_embeddings}
    return {"rope_parameters": {**scaling, "rope_theta": m.rotary_base}, "rope_scaling": scaling}
