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
A tracker or metadata.json that cannot be read as what it should hold (binary, cut short, a list where an
object belongs, a value of the wrong type) is a CheckpointError naming the file and the checkpoint to load
instead.
Only the coordinator (rank 0) writes here; `DIR/run.lock` keeps other runs out (checkpoint/save_lock.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

from megatron_lite.checkpoint.checksums import missing_or_resized
from megatron_lite.config.sections import Config
from megatron_lite.errors import CheckpointError
from megatron_lite.files import check_fields, is_a, read_json_object, read_text

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
        raise CheckpointError(f"{os.path.join(root, TRACKER_FILE)} names iteration {tracked}, but "
                              f"{checkpoint_path(root, tracked)} is not a complete checkpoint; "
                              f"{_without_tracker(complete)}")
    return complete[-1] if complete else None


def _without_tracker(complete: list[int]) -> str:
    """What to do when the tracker cannot be followed, given the complete iterations."""
    if complete:
        return f"the newest complete one is iteration {complete[-1]}: pass --ckpt-step {complete[-1]} to load it"
    return "no complete checkpoint is left: remove the tracker to train from scratch"


def previous_complete(root: str, iteration: int) -> str:
    """How to fall back from a bad checkpoint at `iteration`: the flag loading the newest complete one
    before it, or why there is none."""
    earlier = [i for i in complete_iterations(root) if i < iteration]
    if earlier:
        return f"pass --ckpt-step {earlier[-1]} to load the previous complete checkpoint"
    return f"{root} holds no earlier complete checkpoint"


def read_tracker(root: str) -> int | None:
    """The iteration the tracker file names (None without one); a tracker that names none is an error."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.lexists(path):
        return None
    try:
        text = read_text(path, CheckpointError).strip()
        if not re.fullmatch(r"[0-9]+", text):
            raise CheckpointError(f"{path}: holds {text[:40]!r}, not an iteration number")
    except CheckpointError as error:
        raise CheckpointError(f"{error}; {_without_tracker(complete_iterations(root))}") from None
    return int(text)


# What metadata.json must hold for a load (the rest is informative), and the shape of what it may hold.
_REQUIRED_METADATA = {"iteration": int, "consumed_samples": int, "optimizer": dict, "rng_layout": str}
_OPTIONAL_METADATA = {"files": dict, "config": dict, "layout": dict, "hf": dict}
_FILE_RECORD = {"bytes": int, "crc32": str}


def read_metadata(path: str) -> dict:
    """metadata.json of iteration directory `path`, checked to hold what a load reads from it; a damaged one
    is an error naming the file and, for an iteration of a --save directory, the checkpoint to load instead."""
    file = os.path.join(path, METADATA_FILE)
    try:
        saved = read_json_object(file, CheckpointError)
        check_fields(saved, _REQUIRED_METADATA, _OPTIONAL_METADATA, file, CheckpointError)
        for name, record in saved.get("files", {}).items():
            if not isinstance(record, dict):
                raise CheckpointError(f"{file}: the record of {name} under 'files' is not an object")
            check_fields(record, _FILE_RECORD, {}, f"{file}: the record of {name} under 'files'", CheckpointError)
        check_fields(saved.get("hf", {}), {}, {"config": dict}, f"{file}: 'hf'", CheckpointError)
        for section, values in saved.get("config", {}).items():
            if not isinstance(values, dict):
                raise CheckpointError(f"{file}: config section '{section}' is not an object")
        problem = _config_problem(saved.get("config", {}))
        if problem is not None:
            raise CheckpointError(f"{file}: {problem}")
    except CheckpointError as error:
        match = _ITERATION_DIR.match(os.path.basename(os.path.normpath(path)))
        if match is None:
            raise
        fallback = previous_complete(os.path.dirname(os.path.normpath(path)), int(match.group(1)))
        raise CheckpointError(f"{error}; {fallback}") from None
    return saved


def _config_problem(saved: dict) -> str | None:
    """The first value of a saved run configuration of a type its field does not take (tools rebuild the model
    from it), or None; fields this version does not have are skipped, as config_from_metadata skips them."""
    for section in dataclasses.fields(Config):
        values = saved.get(section.name, {})
        for f in dataclasses.fields(section.default_factory()):
            if f.name in values and not _of_type(values[f.name], str(f.type)):
                return f"config.{section.name}.{f.name} is {json.dumps(values[f.name])[:40]}, expected {f.type}"
    return None


def _of_type(value, annotation: str) -> bool:
    """Whether a JSON value fits a Config field annotated `annotation` ('int | None', 'list[str]', ...)."""
    if value is None:
        return "None" in annotation
    return any(_of_kind(value, kind) for kind in annotation.split(" | ") if kind != "None")


def _of_kind(value, kind: str) -> bool:
    if kind.startswith("list["):
        item = kind.removeprefix("list[").removesuffix("]")
        return isinstance(value, list) and all(_of_type(v, item) for v in value)
    return is_a(value, {"int": int, "float": float, "bool": bool, "str": str}[kind])


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
    fsync(root)
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


def fsync(path: str) -> None:
    """Flush a file's or directory's entries to the disk (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
