"""Every location a run writes, probed on every rank at start-up, before data is read or a model is built.

A location that cannot be written (a path under a regular file, a read-only mount, a directory where a
file is expected) would otherwise fail at its first write: after steps were trained (--profile-dir), on
the logging rank alone while the others wait in a collective (--tensorboard-dir), or with a traceback.
Each rank probes what it will write itself (the last rank its metrics, TensorBoard and W&B outputs, the
profiled ranks their traces and memory snapshots, rank 0 the rerun tracker, every rank the index cache), and
the ranks then agree on the first problem found, so that every rank stops with the same line.
--save is probed with its lock when the checkpointer is built (checkpoint/save_lock.py).
"""

from __future__ import annotations

import os

from megatron_lite.config.sections import Config
from megatron_lite.files import Location, OutputPathError, unwritable


def written_locations(config: Config, rank: int, world_size: int) -> list[Location]:
    """What rank `rank` of a run of `world_size` ranks will write, by the flag that names it."""
    from megatron_lite.training.logging import wandb_project
    from megatron_lite.training.memory_snapshots import records_memory_history, snapshot_path
    from megatron_lite.training.profiling import profile_dir

    log, d = config.logging, config.data
    places = []
    if rank == world_size - 1:  # the logging rank
        if log.metrics_jsonl:
            places.append(Location("--metrics-jsonl", log.metrics_jsonl, True))
        if log.tensorboard_dir:
            places.append(Location("--tensorboard-dir", log.tensorboard_dir, False))
        wandb_dir = log.wandb_save_dir or os.environ.get("WANDB_DIR")
        if wandb_project(log) and wandb_dir:
            places.append(Location("--wandb-save-dir", wandb_dir, False))
    if log.profile and rank in log.profile_ranks:
        places.append(Location("--profile-dir", profile_dir(config), False))
    if records_memory_history(config, rank):
        places.append(Location("--memory-snapshot-path", snapshot_path(config, rank), True))
    if config.training.result_rejected_tracker_filename and rank == 0:
        places.append(Location("--result-rejected-tracker-filename",
                               config.training.result_rejected_tracker_filename, True))
    if d.data_cache_path and not d.mock_data:
        places.append(Location("--data-cache-path", d.data_cache_path, False))
    return places


def check_written_locations(config: Config, rank: int, world_size: int, group=None) -> None:
    """Probe this rank's locations and agree with the other ranks of `group` (None: this process alone):
    every rank raises the first problem any rank found."""
    from megatron_lite.checkpoint.agreement import agree

    problems = (unwritable(location) for location in written_locations(config, rank, world_size))
    agree(next((p for p in problems if p is not None), None), group, OutputPathError)
