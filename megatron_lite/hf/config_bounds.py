"""The types and ranges of config.json's keys, every family's, checked before any key becomes a flag: a value of the
wrong type or out of range is one line naming the key and the value the user wrote and what would be valid, never a
message about the flag or the flag expression (a --moe-layer-freq list) that the conversion would have made of it."""

from __future__ import annotations

import json
import math

from megatron_lite.files import is_a
from megatron_lite.hf.configs import ConversionError

# The types of the config.json keys the families read (null stands for a missing key)
INTEGER_KEYS = ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers",
                "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "head_dim",
                "num_key_value_heads", "max_position_embeddings", "vocab_size", "num_local_experts", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                "decoder_sparse_step", "sliding_window", "n_embd", "n_positions", "n_layer", "n_head", "n_inner",
                "full_attention_interval", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "mamba_num_heads", "mamba_head_dim",
                "ssm_state_size", "n_groups", "conv_kernel", "moe_shared_expert_intermediate_size", "num_heads",
                "state_size")
NUMBER_KEYS = ("rms_norm_eps", "rope_theta", "initializer_range", "attention_dropout", "router_aux_loss_coef",
               "layer_norm_epsilon", "resid_pdrop", "attn_pdrop", "partial_rotary_factor", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings", "routed_scaling_factor", "mscale",
               "mscale_all_dim", "attention_factor", "beta_fast", "beta_slow", "swiglu_alpha", "swiglu_limit")
OBJECT_KEYS = ("rope_parameters", "rope_scaling")

# The smallest value of each integer key (null stands for a missing key and is not checked)
INTEGER_MINIMUMS = {
    **dict.fromkeys(("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "head_dim",
                     "num_key_value_heads", "max_position_embeddings", "num_local_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "decoder_sparse_step", "n_embd", "n_positions",
                     "n_layer", "n_head", "n_inner", "full_attention_interval", "linear_conv_kernel_dim",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "n_routed_experts", "n_group", "topk_group", "q_lora_rank",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mamba_num_heads",
                     "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "num_heads", "state_size"), 1),
    **dict.fromkeys(("num_experts", "shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                     "num_nextn_predict_layers", "sliding_window", "moe_shared_expert_intermediate_size"), 0),
    "vocab_size": 2,
}
POSITIVE_NUMBERS = ("rms_norm_eps", "layer_norm_epsilon", "rope_theta", "initializer_range", "routed_scaling_factor",
                    "factor", "beta_fast", "beta_slow", "swiglu_alpha", "swiglu_limit")
NON_NEGATIVE_NUMBERS = ("mscale", "mscale_all_dim", "router_aux_loss_coef")
FRACTIONS = ("attention_dropout", "resid_pdrop", "attn_pdrop")  # in [0, 1)


def _bound_problem(record: dict, where: str) -> str | None:
    for key, minimum in INTEGER_MINIMUMS.items():
        value = record.get(key)
        if isinstance(value, int) and value < minimum:
            return f"{where}: '{key}' is {value}; it must be at least {minimum}"
    for key in (*POSITIVE_NUMBERS, *NON_NEGATIVE_NUMBERS, *FRACTIONS):
        value = record.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            return f"{where}: '{key}' is {value}; it must be a finite number"
        if key in POSITIVE_NUMBERS and value <= 0:
            return f"{where}: '{key}' is {value}; it must be positive"
        if key in NON_NEGATIVE_NUMBERS and value < 0:
            return f"{where}: '{key}' is {value}; it must not be negative"
        if key in FRACTIONS and not 0 <= value < 1:
            return f"{where}: '{key}' is {value}; it must be at least 0 and below 1"
    return None


def _relation_problem(hf: dict) -> str | None:
    """Keys that must agree with each other."""
    layers = hf.get("num_hidden_layers")
    if isinstance(layers, int):
        dense = hf.get("first_k_dense_replace")
        if isinstance(dense, int) and dense > layers:
            return (f"config.json: 'first_k_dense_replace' is {dense}, more than the {layers} layers "
                    f"('num_hidden_layers'); it must be at most {layers}")
        outside = [i for i in hf.get("mlp_only_layers") or [] if not (isinstance(i, int) and 0 <= i < layers)]
        if outside:
            return (f"config.json: 'mlp_only_layers' names {outside}, not layers of the {layers} "
                    f"('num_hidden_layers'); give indices from 0 to {layers - 1}")
    experts_key = next((k for k in ("n_routed_experts", "num_local_experts", "num_experts") if hf.get(k)), None)
    experts = hf.get(experts_key) if experts_key else None
    groups, group_topk, topk = hf.get("n_group"), hf.get("topk_group"), hf.get("num_experts_per_tok")
    if experts and isinstance(groups, int) and experts % groups:
        return f"config.json: 'n_group' ({groups}) must divide '{experts_key}' ({experts})"
    if isinstance(groups, int) and isinstance(group_topk, int) and group_topk > groups:
        return f"config.json: 'topk_group' ({group_topk}) must not exceed 'n_group' ({groups})"
    if experts and isinstance(topk, int) and topk > experts:
        return f"config.json: 'num_experts_per_tok' ({topk}) must not exceed '{experts_key}' ({experts})"
    return None


def check_config_json(hf: dict) -> None:
    """A ConversionError naming the first key of config.json (or of its RoPE parameters) of the wrong type, out of
    its range, or disagreeing with another."""
    records = [("config.json", hf)] + [(f"config.json's {key}", hf[key]) for key in OBJECT_KEYS
                                       if isinstance(hf.get(key), dict)]
    for where, record in records:
        for keys, kind, name in ((INTEGER_KEYS, int, "an integer"), (NUMBER_KEYS, float, "a number"),
                                 (OBJECT_KEYS, dict, "an object")):
            for key in keys:
                value = record.get(key)
                if value is not None and not is_a(value, kind):
                    raise ConversionError(f"{where}: '{key}' is {json.dumps(value)[:40]}, expected {name}")
    for where, record in records:
        problem = _bound_problem(record, where)
        if problem:
            raise ConversionError(problem)
    problem = _relation_problem(hf)
    if problem:
        raise ConversionError(problem)
