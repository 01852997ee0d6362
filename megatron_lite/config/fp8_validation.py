"""Configuration checks of FP8 training (model/fp8.py), run by validation.validate before torch is imported:
a recipe that is built, a precision it composes with, bf16 layer counts that leave some layer in FP8."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config

BUILT_RECIPES = ("tensorwise", "rowwise")


def fp8_problems(config: Config) -> list[str]:
    """One line per problem with --fp8-format and its flags (what each flag needs is flag_dependencies.py's)."""
    m = config.model
    if m.fp8_format is None:
        return []
    problems = []
    if m.fp8_recipe not in BUILT_RECIPES:
        problems.append(f"--fp8-recipe {m.fp8_recipe} is not built; use {' or '.join(BUILT_RECIPES)}")
    if config.optimizer.fp16:
        problems.append("--fp8-format does not go with --fp16 (fp16 activations and loss scaling around FP8 GEMMs "
                        "are not built); use --bf16")
    if m.fp8_margin < 0:
        problems.append(f"--fp8-margin ({m.fp8_margin}) must be 0 or more")
    if not m.first_last_layers_bf16:
        return problems
    start, end = m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16
    for flag, value in (("num-layers-at-start-in-bf16", start), ("num-layers-at-end-in-bf16", end)):
        if not 0 <= value <= m.num_layers:
            problems.append(f"--{flag} ({value}) must be between 0 and num-layers ({m.num_layers})")
    if not problems and start + end >= m.num_layers:
        problems.append(f"--num-layers-at-start-in-bf16 ({start}) + --num-layers-at-end-in-bf16 ({end}) cover all "
                        f"{m.num_layers} layers, so no layer would run in FP8; lower them or drop --fp8-format")
    return problems
