"""Llama (transformers' llama): the network the other Llama-derived families vary, how it is recognised, and its
name table. Its config.json both ways is llama_config.py's, which those families build on.

RMSNorm, SwiGLU, RoPE and no biases; Llama 3.1's RoPE scaling (rope_type "llama3") is --use-rope-scaling. Variants
our model cannot reproduce exactly (other RoPE scalings, attention or MLP biases) are refused with one line.
"""

from __future__ import annotations

from megatron_lite.config.layer_pattern import moe_layer_pattern
from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.families.family import Family
from megatron_lite.hf.families.gpt_oss import gpt_oss_options
from megatron_lite.hf.llama_config import llama_config, llama_values
from megatron_lite.hf.name_tables import NameTable, llama_attention, llama_names, swiglu_mlp


def plain_norms_and_attention(m: ModelConfig) -> bool:
    """None of the norm and attention options that only Qwen3-Next (zero-centred norms, an output gate, partial
    RoPE) or gpt-oss has."""
    return not (m.apply_layernorm_1p or m.attention_output_gate or m.rotary_percent != 1 or gpt_oss_options(m))


def plain_attention(m: ModelConfig) -> bool:
    """Softmax attention without Qwen2's q/k/v biases, Qwen3's q/k norms or Llama 3.1's RoPE scaling."""
    return not m.qk_layernorm and not m.add_qkv_bias and not m.use_rope_scaling


def _llama_like(m: ModelConfig) -> bool:
    return (m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope"
            and m.disable_bias_linear and plain_norms_and_attention(m))


def dense_llama(m: ModelConfig) -> bool:
    """A Llama-shaped network without experts or latent attention: Llama, Qwen2 or Qwen3, told by its attention."""
    return _llama_like(m) and not m.num_experts and not m.multi_latent_attention


def moe_llama(m: ModelConfig) -> bool:
    """A Llama-shaped network with experts in every layer routed by a softmax (no expert bias, groups or scaling):
    Mixtral, Qwen3-MoE or Qwen2-MoE, told by its attention and shared expert."""
    return bool(m.num_experts and _llama_like(m) and all(moe_layer_pattern(m)) and not m.multi_latent_attention
                and m.moe_router_score_function == "softmax" and not m.moe_router_enable_expert_bias
                and m.moe_router_num_groups is None and m.moe_router_topk_scaling_factor is None
                and not m.use_rope_scaling)


def _name_table(m: ModelConfig) -> NameTable:
    """A dense SwiGLU MLP in every layer (Qwen2's and Qwen3's too)."""
    layer = llama_attention(m) + swiglu_mlp("decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp.",
                                            lambda m: m.ffn_hidden_size)
    return llama_names(m, lambda spec: layer)


LLAMA = Family("llama", llama_values, llama_config,
               lambda m: dense_llama(m) and not m.qk_layernorm and not m.add_qkv_bias, _name_table)
