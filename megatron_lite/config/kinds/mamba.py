"""Mamba-2 layers (the `M` of --hybrid-layer-pattern; Nemotron-H, Nemotron 3) as the configuration knows them:
their flags, with Megatron-Core's names, and their checks at a layout (the model's side: model/kinds/mamba.py)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.kinds.kind import ConfigKind


@dataclass
class MambaConfig:
    mamba_state_dim: int = 128
    """with M layers in --hybrid-layer-pattern: the state size of each Mamba-2 head (d_state)"""
    mamba_head_dim: int = 64
    """with M layers: the channels of each Mamba-2 head"""
    mamba_num_groups: int = 8
    """with M layers: groups of Mamba-2 heads, each sharing one B and one C (tensor parallelism splits them)"""
    mamba_num_heads: int | None = None
    """with M layers: Mamba-2 heads per layer, a multiple of --mamba-num-groups; default: 2 x hidden-size /
    mamba-head-dim"""


def _problems(config) -> list[str]:
    """One line per problem with the Mamba-2 sizes at this layout, where the pattern has M layers."""
    m, p = config.model, config.parallel
    if "M" not in (m.hybrid_layer_pattern or ""):
        return []
    if m.mamba_num_heads is None and (2 * m.hidden_size) % m.mamba_head_dim:
        return [f"2 x hidden-size ({2 * m.hidden_size}) must be divisible by mamba-head-dim ({m.mamba_head_dim}) "
                f"for the default Mamba-2 heads; or give --mamba-num-heads"]
    heads = m.mamba_num_heads or 2 * m.hidden_size // m.mamba_head_dim
    groups, tp = m.mamba_num_groups, p.tensor_model_parallel_size
    problems = []
    if heads % groups:
        problems.append(f"mamba-num-heads ({heads}) must be a multiple of mamba-num-groups ({groups}): each group "
                        f"of heads shares one B and one C")
    if groups % tp:
        problems.append(f"tensor-model-parallel-size ({tp}) must divide mamba-num-groups ({groups}): tensor "
                        f"parallelism splits the Mamba-2 groups")
    cp = p.context_parallel_size
    if cp > 1 and not groups % tp and (groups // tp) % cp:
        problems.append(f"context-parallel-size ({cp}) must divide the Mamba-2 groups of each tensor-parallel rank "
                        f"(mamba-num-groups {groups} / tensor-model-parallel-size {tp}): context parallelism splits "
                        f"them")
    if m.fp8_format is not None:
        problems.append("--fp8-format does not apply to Mamba-2 layers (M) yet; drop it or the M layers")
    return problems


KIND = ConfigKind("Mamba-2", "mixer", "megatron_lite.model.kinds.mamba", symbol="M", described="Mamba-2", alone=True,
                  pattern_only=True, section=MambaConfig, problems=_problems,
                  minimums=dict.fromkeys(("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"),
                                         1))
