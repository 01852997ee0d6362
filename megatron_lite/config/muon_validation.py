"""What --optimizer muon and its --muon-* flags refuse, before any process group exists (validation.py)."""

from __future__ import annotations

from megatron_lite.config.muon_coefficients import steps_problem
from megatron_lite.config.sections import Config


def muon_problems(config: Config) -> list[str]:
    """One line per problem: values Muon cannot take, features it lacks (flags without --optimizer muon are
    flag_dependencies.py's)."""
    o = config.optimizer
    if o.optimizer != "muon":
        return []
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
