"""The flags of fault-tolerant data parallelism across replica groups with torchft (torchtitan's
--fault_tolerance.* options under Megatron-style names): a section of TrainingConfig kept in a file of its own,
and its one-line problems."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


@dataclass
class FaultToleranceConfig:
    fault_tolerance: str | None = None
    """torchft: this job is one replica group of --ft-num-replica-groups, each a whole layout of its own (TP x PP x
    CP x EP x DP), whose gradients torchft averages across the live groups after each group's own reduction; a
    group that dies is dropped from the steps until it restarts and takes the live weights and optimizer state
    from a peer (training/fault_tolerance.py); unset: one job, no replica groups"""
    ft_replica_id: int = 0
    """with --fault-tolerance: this replica group's index, 0 .. --ft-num-replica-groups - 1 (its share of each
    step's data)"""
    ft_num_replica_groups: int = 2
    """with --fault-tolerance: replica groups of the job; each trains --global-batch-size samples per step, so
    the job's batch is their product while every group lives"""
    ft_min_replica_size: int = 1
    """with --fault-tolerance: live replica groups a step needs; with fewer the step waits for a quorum"""
    ft_lighthouse: str | None = None
    """with --fault-tolerance: the torchft lighthouse's address (http://HOST:PORT, started by scripts/
    launch_replica_groups.sh); default: $TORCHFT_LIGHTHOUSE"""

    def lighthouse_address(self) -> str | None:
        return self.ft_lighthouse or os.environ.get(LIGHTHOUSE_ENV)


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
    if t.lighthouse_address() is None:
        problems.append(f"--fault-tolerance torchft needs the lighthouse's address: --ft-lighthouse "
                        f"http://HOST:PORT or ${LIGHTHOUSE_ENV}")
    if t.rampup_batch_size is not None:
        problems.append("--fault-tolerance does not support --rampup-batch-size: a healed group finds its data by "
                        "its step, so each step must take the same samples")
    return problems
