"""Configuration checks of multi-token prediction (model/mtp.py), run by validation.validate before any process
group exists: one line per problem, saying what to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


def mtp_problems(config: Config) -> list[str]:
    """What --mtp-num-layers cannot be given with what else is set (the bounds of single values are
    validation.py's)."""
    m = config.model
    problems = []
    if m.mtp_num_layers is None:
        return problems
    if m.mtp_num_layers >= m.seq_length:  # depth k predicts token i + k + 1: seq-length - k targets a sequence
        problems.append(f"--mtp-num-layers ({m.mtp_num_layers}) leaves depth {m.seq_length} without a target in a "
                        f"sequence of --seq-length {m.seq_length} (depth k predicts token i + k + 1); use at most "
                        f"{m.seq_length - 1} depths")
    return problems
