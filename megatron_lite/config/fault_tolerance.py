"""The flags of fault-tolerant data parallelism across replica groups with torchft (torchtitan's
--fault_tolerance.* options under Megatron-style names): a section of TrainingConfig kept in a file of its own
(fault_tolerance_validation.py checks them)."""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass

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

    def lighthouse_source(self) -> str:
        """Where the lighthouse's address came from, with the address, as a message about it names it."""
        if self.ft_lighthouse:
            return f"--ft-lighthouse {self.ft_lighthouse}"
        return f"${LIGHTHOUSE_ENV} ({self.lighthouse_address()})"


def lighthouse_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a lighthouse URL, http(s)://HOST:PORT, or None for anything else (torchft's client reads
    only such a URL, and a bare HOST:PORT ends in its quorum timeout, with no word of the address)."""
    try:
        parts = urllib.parse.urlsplit(address)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        return None
    return parts.hostname, port
