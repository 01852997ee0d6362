"""The checkpoint directory: which iterations are complete, and committing a new one atomically.

    DIR/latest_checkpointed_iteration.txt   the newest committed iteration (Megatron's tracker file)
    DIR/iter_0000100/                       a torch.distributed.checkpoint directory + metadata.json
    DIR/iter_0000200.tmp/                   a save in progress (or killed): never read

A save writes into `iter_XXXXXXX.tmp`, then the coordinator writes `metadata.json` last and renames the
directory: the rename is the commit, so a directory with a final name is complete, and a save killed at
any moment leaves the previous checkpoints untouched. The tracker file is then replaced atomically
(write a temporary file, rename). Before the commit, every data file the ranks reported writing (with
its checksum, checkpoint/checksums.py) must be present with its size: a save whose files another process
removed is never committed.

Loading takes the newest complete iteration, so a crash between the rename and the tracker update loses
nothing; `--ckpt-step N` takes iteration N instead. A tracker naming an iteration with no complete
directory is an error, not a silent start from scratch: the checkpoint it promises was deleted or lost.
Only the coordinator (rank 0) writes here; `DIR/run.lock` keeps other runs out (checkpoint/save_lock.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil

from megatron_lite.checkpoint.checksums import missing_or_resized
from megatron_lite.checkpoint.planner import CheckpointError

TRACKER_FILE = "latest_checkpointed_iteration.txt"
METADATA_FILE = "metadata.json"
_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
_LEFTOVERS = (".tmp", ".replaced", ".deleting")  # suffixes of directories no reader ever uses


def checkpoint_path(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def temporary_path(root: str, iteration: int) -> str:
    return checkpoint_path(root, iteration) + ".tmp"


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE)) and os.path.isfile(os.path.join(path, ".metadata"))


def complete_iterations(root: str) -> list[int]:
    """Iterations with a complete checkpoint under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _ITERATION_DIR.match(name)
        if match and is_complete(os.path.join(root, name)):
            found.append(int(match.group(1)))
    return sorted(found)


def latest_iteration(root: str) -> int | None:
    """The newest complete iteration, or None when `root` holds none."""
    iterations = complete_iterations(root)
    return iterations[-1] if iterations else None


def iteration_to_load(root: str, ckpt_step: int | None = None) -> int | None:
    """The iteration `--load root` resumes from: `ckpt_step` when given, else the newest complete one; None
    (start from scratch) only when `root` holds neither a checkpoint nor a tracker."""
    complete = complete_iterations(root)
    if ckpt_step is not None:
        if ckpt_step not in complete:
            raise CheckpointError(f"--ckpt-step {ckpt_step}: {checkpoint_path(root, ckpt_step)} is not a complete "
                                  f"checkpoint; complete iterations in {root}: {complete or 'none'}")
        return ckpt_step
    tracked = read_tracker(root)
    if tracked is not None and tracked not in complete:
        fallback = (f"the newest complete one is iteration {complete[-1]}: pass --ckpt-step {complete[-1]} to load it"
                    if complete else "no complete checkpoint is left: remove the tracker to train from scratch")
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} names iteration {tracked}, but "
                              f"{checkpoint_path(root, tracked)} is not a complete checkpoint; {fallback}")
    return complete[-1] if complete else None


def previous_complete(root: str, iteration: int) -> str:
    """How to fall back from a bad checkpoint at `iteration`: the flag loading the newest complete one
    before it, or why there is none."""
    earlier = [i for i in complete_iterations(root) if i < iteration]
    if earlier:
        return f"pass --ckpt-step {earlier[-1]} to load the previous complete checkpoint"
    return f"{root} holds no earlier complete checkpoint"


def read_tracker(root: str) -> int | None:
    try:
        with open(os.path.join(root, TRACKER_FILE)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def read_metadata(path: str) -> dict:
    try:
        with open(os.path.join(path, METADATA_FILE)) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{os.path.join(path, METADATA_FILE)} is damaged ({error})") from error


def prepare(root: str, iteration: int) -> str:
    """An empty temporary directory for a new save; leftovers of killed saves are removed first."""
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith(_LEFTOVERS):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    path = temporary_path(root, iteration)
    os.makedirs(path)
    return path


def _write_atomically(path: str, text: str) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def commit(root: str, iteration: int, metadata: dict, keep_last_n: int | None = None) -> str:
    """Finish a save whose tensors are all written: metadata.json, rename, tracker, old checkpoints. The files
    recorded in `metadata["files"]` must all be there as written, or nothing is committed."""
    temporary, final = temporary_path(root, iteration), checkpoint_path(root, iteration)
    problem = missing_or_resized(temporary, metadata.get("files", {}))
    if problem is not None:
        raise CheckpointError(f"not committing the checkpoint of iteration {iteration}: {problem} (is another "
                              f"process writing into {root}?)")
    _write_atomically(os.path.join(temporary, METADATA_FILE), json.dumps(metadata, indent=1, sort_keys=True))
    if os.path.exists(final):  # the same iteration saved again: move the old one aside, never delete first
        os.replace(final, final + ".replaced")
    os.replace(temporary, final)
    _fsync_directory(root)
    _write_atomically(os.path.join(root, TRACKER_FILE), f"{iteration}\n")
    shutil.rmtree(final + ".replaced", ignore_errors=True)
    if keep_last_n:
        for old in complete_iterations(root)[:-keep_last_n]:
            _remove(checkpoint_path(root, old))
    return final


def _remove(path: str) -> None:
    """Rename first, so that a deletion cut short never leaves a half-deleted checkpoint under a final name."""
    os.replace(path, path + ".deleting")
    shutil.rmtree(path + ".deleting", ignore_errors=True)


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
