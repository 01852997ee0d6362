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
    problem = steps_problem(o.muon_coefficient_type, o.muon_num_ns_steps) if o.muon_num_ns_steps >= 1 else None
    if problem:
        problems.append(problem)
    if o.optimizer_cpu_offload:
        problems.append("--optimizer-cpu-offload steps AdamW only; drop it with --optimizer muon")
    return problems
