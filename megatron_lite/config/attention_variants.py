"""The model flags of hybrid architectures, whose layers are not all softmax attention (Qwen3-Next, Qwen3.5):
a section of ModelConfig kept in a file of its own, with Megatron-Core's TransformerConfig names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AttentionVariantsConfig:
    experimental_attention_variant: str | None = None
    """gated_delta_net: the layers --linear-attention-freq picks mix tokens by Gated DeltaNet (a gated delta rule
    over a recurrent state, model/linear_attention) instead of softmax attention (Qwen3-Next, Qwen3.5); unset:
    softmax attention in every layer"""
    linear_attention_freq: str | int | list[int] = 4
    """with --experimental-attention-variant: N: N - 1 linear-attention layers, then one softmax-attention layer,
    repeated (Qwen3-Next: 4); or one 1 (linear) / 0 (softmax) per layer as a list expression such as
    ([1]*3+[0])*12 (config/layer_pattern.py)"""
    linear_conv_kernel_dim: int = 4
    """with --experimental-attention-variant: width of the causal depthwise convolution over the linear layers'
    queries, keys and values"""
    linear_key_head_dim: int = 128
    """with --experimental-attention-variant: dimension of each linear-attention query and key head"""
    linear_value_head_dim: int = 128
    """with --experimental-attention-variant: dimension of each linear-attention value head"""
    linear_num_key_heads: int = 16
    """with --experimental-attention-variant: query/key heads of each linear-attention layer"""
    linear_num_value_heads: int = 32
    """with --experimental-attention-variant: value heads of each linear-attention layer, a multiple of its key
    heads (each key head serves a group of value heads)"""
