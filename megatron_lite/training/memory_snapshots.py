"""--record-memory-history: the CUDA caching allocator's history, dumped for pytorch.org/memory_viz.

As Megatron: each rank of --profile-ranks records the allocator's events from before the model is built
(every tensor's allocation, with the Python stack that made it) and dumps them to
--memory-snapshot-path as BASE_RANK.EXT at every log interval, and to BASE_oom_rank_RANK.EXT when an
allocation fails. The first dump and an out-of-memory dump print one line naming the file beside the
planner's prediction for the rank (planning/), so that a surprise is visible at once. The allocator's
history exists on CUDA only: validation_problem refuses the flag elsewhere.
"""

from __future__ import annotations

import os

import torch

from megatron_lite.config.sections import Config

_MAX_ENTRIES = 100_000  # Megatron's: the newest 100k allocation and free events


def records_memory_history(config: Config, rank: int) -> bool:
    return config.logging.record_memory_history and rank in config.logging.profile_ranks


def snapshot_path(config: Config, rank: int, out_of_memory: bool = False) -> str:
    base, extension = os.path.splitext(config.logging.memory_snapshot_path)
    return f"{base}_oom_rank_{rank}{extension}" if out_of_memory else f"{base}_{rank}{extension}"


def validation_problem(config: Config, device: torch.device) -> str | None:
    """Why --record-memory-history cannot run on `device`, or None."""
    if config.logging.record_memory_history and device.type != "cuda":
        return (f"--record-memory-history records the CUDA caching allocator, and this run is on the "
                f"{device.type}: drop the flag (on a CPU, --profile shows memory per operator)")
    return None


def predicted_peak_bytes(config: Config, pp_rank: int) -> int:
    """The planner's total for a rank of pipeline stage `pp_rank` (state plus peak activations)."""
    from megatron_lite.planning.layouts import plan_layout
    from megatron_lite.planning.step_time import Hardware

    plan = plan_layout(config, memory_bytes=0, hardware=Hardware())
    return next(stage.total for stage in plan.stages if stage.pp_rank == pp_rank)


class MemoryHistory:
    """The allocator history of one rank, started at construction (before the model is built)."""

    def __init__(self, config: Config, rank: int, pp_rank: int, device: torch.device):
        self.config, self.rank, self.pp_rank, self.device = config, rank, pp_rank, device
        self.enabled = records_memory_history(config, rank)
        self.announced = False
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES, device=device)
            torch._C._cuda_attach_out_of_memory_observer(self._on_out_of_memory)

    def dump(self, iteration: int) -> None:
        """At a log interval: the history so far, replacing the previous dump."""
        if not self.enabled:
            return
        path = snapshot_path(self.config, self.rank)
        torch.cuda.memory._dump_snapshot(path)
        if not self.announced:
            self.announced = True
            print(f" rank {self.rank}: memory snapshot of iteration {iteration} written to {path} "
                  f"({self._compared()})", flush=True)

    def _on_out_of_memory(self, device: int, requested: int, device_allocated: int, device_free: int) -> None:
        path = snapshot_path(self.config, self.rank, out_of_memory=True)
        torch.cuda.memory._dump_snapshot(path)
        print(f" rank {self.rank}: out of memory asking for {requested / 2**30:.2f} GiB with "
              f"{device_allocated / 2**30:.2f} GiB allocated and {device_free / 2**30:.2f} GiB free; memory "
              f"snapshot written to {path} ({self._compared()})", flush=True)

    def _compared(self) -> str:
        peak = torch.cuda.max_memory_allocated(self.device)
        predicted = predicted_peak_bytes(self.config, self.pp_rank)
        return f"peak allocated {peak / 2**30:.2f} GiB; the planner predicts {predicted / 2**30:.2f} GiB for this rank"

    def close(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            self.enabled = False
