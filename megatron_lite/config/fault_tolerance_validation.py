"""One line per problem with --fault-tolerance and its flags (config/fault_tolerance.py)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from megatron_lite.config.fault_tolerance import LIGHTHOUSE_ENV, lighthouse_endpoint

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


def fault_tolerance_problems(config: Config) -> list[str]:
    """One line per problem with --fault-tolerance."""
    t = config.training
    if t.fault_tolerance is None:
        return []
    problems = []
    if importlib.util.find_spec("torchft") is None:
        problems.append("--fault-tolerance torchft needs the torchft package: pip install torchft")
    if not 0 <= t.ft_replica_id < t.ft_num_replica_groups:
        problems.append(f"ft-replica-id ({t.ft_replica_id}) must be in 0 .. ft-num-replica-groups - 1 "
                        f"({t.ft_num_replica_groups - 1})")
    if not 1 <= t.ft_min_replica_size <= t.ft_num_replica_groups:
        problems.append(f"ft-min-replica-size ({t.ft_min_replica_size}) must be in 1 .. ft-num-replica-groups "
                        f"({t.ft_num_replica_groups})")
    address = t.lighthouse_address()
    if address is None:
        problems.append(f"--fault-tolerance torchft needs the lighthouse's address: --ft-lighthouse "
                        f"http://HOST:PORT or ${LIGHTHOUSE_ENV}")
    elif lighthouse_endpoint(address) is None:
        problems.append(f"{t.lighthouse_source()} must be the lighthouse's URL, http://HOST:PORT (torchft's "
                        f"lighthouse prints it as it starts)")
    if t.rampup_batch_size is not None:
        problems.append("--fault-tolerance does not support --rampup-batch-size: a healed group finds its data by "
                        "its step, so each step must take the same samples")
    return problems
