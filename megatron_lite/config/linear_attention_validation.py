"""Configuration checks of Gated DeltaNet layers (--experimental-attention-variant): each problem one line saying
what to change, raised on every rank before a process group or a model exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_lite.config.layer_pattern import linear_attention_pattern

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


def linear_attention_problems(config: Config) -> list[str]:
    """One line per problem with the Gated DeltaNet flags at this layout; nothing without the variant."""
    m, p = config.model, config.parallel
    if m.experimental_attention_variant is None:
        return []
    problems = []
    key_heads, value_heads = m.linear_num_key_heads, m.linear_num_value_heads
    if value_heads % key_heads:
        problems.append(f"linear-num-value-heads ({value_heads}) must be a multiple of linear-num-key-heads "
                        f"({key_heads}): each key head serves a group of value heads")
    if key_heads % p.tensor_model_parallel_size:
        problems.append(f"tensor-model-parallel-size ({p.tensor_model_parallel_size}) must divide "
                        f"linear-num-key-heads ({key_heads}): tensor parallelism splits the linear-attention heads")
    if p.context_parallel_size > 1 and any(linear_attention_pattern(m)):
        problems.append("Gated DeltaNet layers do not run under context parallelism yet; use "
                        "--context-parallel-size 1, or softmax attention in every layer")
    if m.fp8_format is not None and any(linear_attention_pattern(m)):
        problems.append("--fp8-format does not apply to Gated DeltaNet layers yet; drop it or the variant")
    return problems
