"""What --optimizer muon and its --muon-* flags refuse, before any process group exists (validation.py)."""

from __future__ import annotations

import dataclasses

from megatron_lite.config import Config, OptimizerConfig
from megatron_lite.optim.muon import steps_problem


def muon_problems(config: Config) -> list[str]:
    """One line per problem: Muon flags without --optimizer muon, values Muon cannot take, features it lacks."""
    o = config.optimizer
    if o.optimizer != "muon":
        defaults = OptimizerConfig()
        changed = [f.name for f in dataclasses.fields(o)
                   if f.name.startswith("muon_") and getattr(o, f.name) != getattr(defaults, f.name)]
        return [f"--{changed[0].replace('_', '-')} takes effect only with --optimizer muon"] if changed else []
    problems = []
    if o.muon_scalar_optimizer != "adam":
        problems.append(f"--muon-scalar-optimizer {o.muon_scalar_optimizer} is not supported; use adam")
    if not 0.0 <= o.muon_momentum < 1.0:
        problems.append(f"--muon-momentum ({o.muon_momentum}) must be in [0, 1)")
    if o.muon_num_ns_steps < 1:
        problems.append(f"--muon-num-ns-steps ({o.muon_num_ns_steps}) must be at least 1")
    else:
        problem = steps_problem(o.muon_coefficient_type, o.muon_num_ns_steps)
        if problem:
            problems.append(problem)
    if not o.muon_extra_scale_factor > 0.0:
        problems.append(f"--muon-extra-scale-factor ({o.muon_extra_scale_factor}) must be positive")
    if o.optimizer_cpu_offload:
        problems.append("--optimizer-cpu-offload steps AdamW only; drop it with --optimizer muon")
    return problems
