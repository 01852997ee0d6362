"""Configuration checks of the DeepSeek-V3 architecture flags: multi-latent attention, YaRN and --moe-layer-freq.

validation.py calls `mla_problems` with the value checks, before any check that builds on the layer pattern, so
each problem is one line saying what to change, raised on every rank before a process group exists.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_lite.config.layer_pattern import layer_pattern_problems

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config, ModelConfig


def _yarn_problems(m: ModelConfig) -> list[str]:
    problems = []
    if math.isfinite(m.yarn_beta_fast) and m.yarn_beta_slow > 0 and not m.yarn_beta_fast > m.yarn_beta_slow:
        problems.append(f"yarn-beta-fast ({m.yarn_beta_fast}) must exceed yarn-beta-slow ({m.yarn_beta_slow})")
    return problems


def _attention_problems(m: ModelConfig) -> list[str]:
    problems = []
    if m.qk_pos_emb_head_dim >= 1 and m.qk_pos_emb_head_dim % 2:
        problems.append(f"RoPE needs an even qk-pos-emb-head-dim, got {m.qk_pos_emb_head_dim}")
    if m.position_embedding_type != "rope":
        problems.append("--multi-latent-attention needs --position-embedding-type rope (its decoupled RoPE key)")
    if m.group_query_attention:
        problems.append("--multi-latent-attention and --group-query-attention exclude each other (every head has "
                        "its own keys, made from one shared latent); drop --group-query-attention")
    if not m.disable_bias_linear or m.add_qkv_bias:
        problems.append("multi-latent attention has no biases: pass --disable-bias-linear, without --add-qkv-bias")
    if m.use_rope_scaling:
        problems.append("--use-rope-scaling (Llama 3.1's) does not apply to multi-latent attention, whose RoPE is "
                        "scaled by YaRN (--rotary-scaling-factor)")
    return problems


def mla_problems(config: Config) -> list[str]:
    """One line per problem with --multi-latent-attention, the YaRN flags or --moe-layer-freq."""
    m = config.model
    problems = layer_pattern_problems(m)
    if m.multi_latent_attention:
        return problems + _attention_problems(m) + _yarn_problems(m)
    if m.position_embedding_type == "yarn":
        return problems + _yarn_problems(m)
    return problems
