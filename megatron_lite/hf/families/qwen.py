"""Qwen2 and Qwen3 (transformers' qwen2, qwen3): Llamas with a bias on q, k and v (Qwen2, --add-qkv-bias) or an
RMSNorm on each query and key head (Qwen3, --qk-layernorm), under Llama's tensor names. Their sliding windows are
refused when on and written off."""

from __future__ import annotations

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse
from megatron_lite.hf.families.family import Family
from megatron_lite.hf.families.llama import LLAMA, dense_llama
from megatron_lite.hf.llama_config import llama_config, llama_values


def _values(hf: dict) -> dict:
    refuse(bool(hf.get("use_sliding_window")), f"sliding-window attention ({hf.get('sliding_window')})")
    if hf["model_type"] == "qwen2":
        return {**llama_values(hf), "add_qkv_bias": True}
    return {**llama_values(hf), "qk_layernorm": True}


def qwen_config(m: ModelConfig, model_type: str, architecture: str) -> dict:
    """Qwen2 has no attention_bias key (its q, k and v always have biases); both have sliding windows, off."""
    config = llama_config(m)
    del config["mlp_bias"]
    if model_type == "qwen2":
        del config["attention_bias"]
    return {**config, "architectures": [architecture], "model_type": model_type, "use_sliding_window": False,
            "sliding_window": None}


QWEN2 = Family("qwen2", _values, lambda m: qwen_config(m, "qwen2", "Qwen2ForCausalLM"),
               lambda m: dense_llama(m) and m.add_qkv_bias and not m.qk_layernorm, LLAMA.name_table)
QWEN3 = Family("qwen3", _values, lambda m: qwen_config(m, "qwen3", "Qwen3ForCausalLM"),
               lambda m: dense_llama(m) and m.qk_layernorm and not m.add_qkv_bias, LLAMA.name_table)
