"""The model flags of the 2025-2026 architectures (Qwen3-Next, Qwen3.5, gpt-oss): linear-attention layers between
the softmax-attention ones, and the softmax-attention options these models use. A section of ModelConfig kept in a
file of its own, with Megatron-Core's TransformerConfig names."""

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
    attention_output_gate: bool = False
    """softmax attention's output multiplied, head by head, by sigmoid of a gate the QKV projection also makes
    (Qwen3-Next, Qwen3.5)"""
    apply_layernorm_1p: bool = False
    """every norm's weight (--normalization, and the --qk-layernorm head norms) stored as w and applied as 1 + w,
    starting at 0 (Megatron's layernorm_zero_centered_gamma; Qwen3-Next)"""
    rotary_percent: float = 1.0
    """the fraction of each head's dimensions RoPE rotates, the leading ones (Qwen3-Next: 0.25)"""
    window_size: list[int] | None = None
    """LEFT RIGHT: sliding-window attention, each query seeing the LEFT keys before it and itself (RIGHT must be 0
    in a causal decoder; gpt-oss: 127 0), in the layers --window-attn-skip-freq leaves windowed; unset: full
    attention"""
    window_attn_skip_freq: str | int | list[int] | None = None
    """with --window-size: N: N - 1 windowed layers, then one full-attention layer, repeated (gpt-oss: 2); or one 1
    (windowed) / 0 (full) per layer as a list expression; unset: every layer windowed"""
    quick_geglu: bool = False
    """a gated MLP whose gate goes through quick GELU, x sigmoid(1.702 x), instead of SiLU (gpt-oss; Megatron's
    --quick-geglu); exclusive with --swiglu"""
    glu_linear_offset: float = 0.0
    """with --swiglu or --quick-geglu: added to the up half before the product, act(gate) (up + offset) (gpt-oss: 1)"""
    activation_func_clamp_value: float | None = None
    """with --swiglu or --quick-geglu: the gate clamped to at most this and the up half to +-this before the
    activation (gpt-oss: 7); unset: no clamp"""
    yarn_correction_range_round_to_int: bool = True
    """with YaRN (--position-embedding-type yarn, or --multi-latent-attention): round the band of blended
    frequencies outwards to whole indices (DeepSeek-V3); gpt-oss trains with --no-yarn-correction-range-round-to-int"""
    softmax_type: str = "vanilla"
    """vanilla: plain softmax; learnable: one more learned logit per head in every softmax denominator, an
    attention sink without a value (gpt-oss); off-by-one: that logit fixed at 0"""
