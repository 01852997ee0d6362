"""Configuration checks of the flags of config/attention_variants.py (Gated DeltaNet layers, the softmax-attention
options of Qwen3-Next): each problem one line saying what to change, raised on every rank before a process group
or a model exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_lite.config.layer_pattern import linear_attention_pattern

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


def attention_variant_problems(config: Config) -> list[str]:
    """One line per problem with the flags of config/attention_variants.py at this layout."""
    return _softmax_option_problems(config) + _linear_attention_problems(config)


def _softmax_option_problems(config: Config) -> list[str]:
    m = config.model
    problems = []
    if not 0 < m.rotary_percent <= 1:
        problems.append(f"rotary-percent ({m.rotary_percent}) must be in (0, 1]")
    elif (m.head_dim * m.rotary_percent) % 2:
        problems.append(f"rotary-percent ({m.rotary_percent}) of the head dimension ({m.head_dim}) must be an even "
                        f"number of dimensions for RoPE to rotate in pairs")
    if m.multi_latent_attention and m.attention_output_gate:
        problems.append("--attention-output-gate is not built for multi-latent attention; drop one of them")
    problems += _window_and_sink_problems(config)
    if m.multi_latent_attention and m.rotary_percent != 1:
        problems.append("--rotary-percent does not apply to multi-latent attention, whose RoPE dimensions are "
                        "--qk-pos-emb-head-dim")
    return problems


def _window_and_sink_problems(config: Config) -> list[str]:
    m = config.model
    window, sinks = m.window_size, m.softmax_type != "vanilla"
    if window is None and not sinks:
        return []
    problems = []
    if window is not None and (len(window) != 2 or window[0] < 0 or window[1] != 0):
        problems.append(f"window-size {window} must be LEFT 0 with LEFT >= 0 (a causal decoder sees no key after "
                        f"the query)")
    what = "--window-size" if window is not None else f"--softmax-type {m.softmax_type}"
    if m.multi_latent_attention:
        problems.append(f"{what} is not built for multi-latent attention; drop one of them")
    if m.attention_dropout > 0:
        problems.append(f"{what} needs --attention-dropout 0 (its attention has no dropout)")
    if m.attention_backend == "flash":
        problems.append(f"{what} computes its attention itself; drop --attention-backend flash")
    return problems


def _linear_attention_problems(config: Config) -> list[str]:
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
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    if cp > 1 and not key_heads % tp and (key_heads // tp) % cp and any(linear_attention_pattern(m)):
        problems.append(f"context-parallel-size ({cp}) must divide the linear-attention key heads of each tensor-"
                        f"parallel rank (linear-num-key-heads {key_heads} / tensor-model-parallel-size {tp}): "
                        f"context parallelism splits them for the Gated DeltaNet layers")
    if m.fp8_format is not None and any(linear_attention_pattern(m)):
        problems.append("--fp8-format does not apply to Gated DeltaNet layers yet; drop it or the variant")
    return problems
