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
import socket
from typing import NamedTuple

from megatron_lite.config import Config
from megatron_lite.errors import UserError


class OutputPathError(UserError, OSError):
    """A location the run would write cannot be written; the message names the flag, the path and the host."""


class Location(NamedTuple):
    flag: str
    path: str
    is_file: bool  # a file the run creates or appends to; else a directory it writes files into


def written_locations(config: Config, rank: int, world_size: int) -> list[Location]:
    """What rank `rank` of a run of `world_size` ranks will write, by the flag that names it."""
    from megatron_lite.logging import wandb_project
    from megatron_lite.memory_snapshots import records_memory_history, snapshot_path
    from megatron_lite.profiling import profile_dir

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


def unwritable(location: Location) -> str | None:
    """Why this process cannot write `location` (its directories are made if missing), or None."""
    why = why_unwritable(location.path, location.is_file, create=True)
    if why is None:
        return None
    return f"{location.flag} {location.path} cannot be written on {socket.gethostname()}: {why}"


def why_unwritable(path: str, is_file: bool, create: bool = False) -> str | None:
    """What keeps this process from writing `path` (a file, or a directory to write files into), or None.
    With `create`, missing directories are made and a probe file written and removed; without, nothing is
    made: the nearest existing directory must accept new entries (for a tool that checks before working)."""
    directory = os.path.dirname(os.path.abspath(path)) if is_file else path
    if is_file and os.path.isdir(path):
        return "it is a directory; name a file"
    if not is_file and os.path.exists(path) and not os.path.isdir(path):
        return "it is a file; name a directory"
    blocking = _file_on_the_way(directory)
    if blocking is not None:
        return f"{blocking} is a file, not a directory"
    if is_file and os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file is read-only"
    if not create:
        nearest = _nearest_existing(directory)
        return None if os.access(nearest, os.W_OK | os.X_OK) else f"{nearest} does not accept new files"
    probe = os.path.join(directory, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe\n")
        os.remove(probe)
    except OSError as error:
        return error.strerror or str(error)
    return None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _file_on_the_way(directory: str) -> str | None:
    """The existing non-directory among `directory` and its parents, if any: no directory can be made there."""
    nearest = _nearest_existing(directory)
    return None if os.path.isdir(nearest) else nearest


def check_written_locations(config: Config, rank: int, world_size: int, group=None) -> None:
    """Probe this rank's locations and agree with the other ranks of `group` (None: this process alone):
    every rank raises the first problem any rank found."""
    from megatron_lite.checkpoint.agreement import agree

    problems = (unwritable(location) for location in written_locations(config, rank, world_size))
    agree(next((p for p in problems if p is not None), None), group, OutputPathError)
