"""Megatron-LM checkpoint directories: finding the iteration, reading its saved state and model tensors.

    DIR/latest_checkpointed_iteration.txt   the iteration to load (a number, or "release")
    DIR/iter_0000100/                       torch_dist: metadata.json ({"sharded_backend": "torch_dist"}),
                                            common.pt (args, iteration, scheduler), .metadata + __R_I.distcp
                                            (torch.distributed.checkpoint: the sharded tensors, global keys)
    DIR/iter_0000100/mp_rank_TT[_PPP]/      torch: model_optim_rng.pt, one per tensor and pipeline rank
                    model_optim_rng.pt      (args, iteration, scheduler, the rank's own parameter shards)

`open_checkpoint` finds the iteration directory and tells the two formats apart; each reader gives the saved
state (the pickle without its tensors), the global shape of every tensor under Megatron's key (the model's,
and for torch_dist the optimizer's), and reads tensors (or single layers of stacked ones) on request:
torch_dist reads just those boxes, torch a pipeline stage's files at a time.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_lite.checkpoint.planner import SafeFileSystemReader, ShardedLoadPlanner, state_dict_of
from megatron_lite.checkpoint.sharded import ShardedTensor
from megatron_lite.errors import CheckpointError
from megatron_lite.megatron_lm import legacy_torch
from megatron_lite.megatron_lm.names import Source, is_extra_state
from megatron_lite.megatron_lm.pickles import load_megatron_pickle

TRACKER_FILE = "latest_checkpointed_iteration.txt"
_ITERATION_DIR = re.compile(r"^iter_(\d{7})$")
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")


def is_megatron_iteration(path: str) -> bool:
    """Whether `path` is one iteration of a Megatron-LM checkpoint (either format)."""
    return _format_of(path) is not None


def _format_of(path: str) -> str | None:
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "common.pt")) or _sharded_backend(path) is not None:
        return "torch_dist"
    if any(legacy_torch.RANK_DIR.match(name) for name in os.listdir(path)):
        return "torch"
    return None


def _sharded_backend(path: str) -> str | None:
    """The `sharded_backend` metadata.json of a Megatron-Core distributed checkpoint names, if it names one."""
    file = os.path.join(path, "metadata.json")
    try:
        with open(file, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved.get("sharded_backend") if isinstance(saved, dict) else None


def find_iteration(path: str) -> tuple[str, int | None]:
    """The iteration directory `path` names (itself, or the one its tracker file names) and its iteration."""
    name = os.path.basename(os.path.normpath(path))
    if is_megatron_iteration(path):
        match = _ITERATION_DIR.match(name)
        return path, int(match.group(1)) if match else None
    tracker = os.path.join(path, TRACKER_FILE)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{path} is not a Megatron-LM checkpoint: it has no {TRACKER_FILE} and is not an "
                              f"iter_XXXXXXX directory")
    with open(tracker, encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(path, "release"), 0
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number or 'release'")
    iteration_dir = os.path.join(path, f"iter_{int(text):07d}")
    if not is_megatron_iteration(iteration_dir):
        raise CheckpointError(f"{tracker} names iteration {int(text)}, but {iteration_dir} is not a Megatron-LM "
                              f"checkpoint (missing or incomplete)")
    return iteration_dir, int(text)


class TorchDistCheckpoint:
    """One iteration saved with --ckpt-format torch_dist."""

    format = "torch_dist"

    def __init__(self, path: str):
        self.path = path
        backend = _sharded_backend(path)
        if not os.path.isfile(os.path.join(path, "metadata.json")):
            raise CheckpointError(f"{path} has no metadata.json: the Megatron-LM torch_dist checkpoint is "
                                  f"incomplete (a save cut short?)")
        if backend != "torch_dist":
            raise CheckpointError(f"{path}/metadata.json names sharded_backend {backend!r}; only torch_dist (and "
                                  f"the torch format) are read")
        self.saved = load_megatron_pickle(os.path.join(path, "common.pt"))
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(f"{path} has no .metadata: the torch_dist checkpoint is incomplete")
        metadata = SafeFileSystemReader(path).read_metadata()
        _check_data_files(path, metadata.storage_data)
        index = metadata.state_dict_metadata
        self.shapes = {key: tuple(entry.size) for key, entry in index.items()
                       if isinstance(entry, TensorStorageMetadata) and not is_extra_state(key)}
        self.dtypes = {key: index[key].properties.dtype for key in self.shapes}

    def model_keys(self) -> list[str]:
        return [key for key in self.shapes if key.startswith(MODEL_PREFIXES)]

    def read(self, sources: dict[str, Source]) -> dict[str, torch.Tensor]:
        """Our tensors, by name, each read from its Source (a layer of a stacked key reads just that box)."""
        pieces = {}
        for name, source in sources.items():
            shape = self.shapes[source.key]
            box = (1,) * len(source.index) + shape[len(source.index):]
            offset = (*source.index, *(0,) * (len(shape) - len(source.index)))
            pieces[name] = ShardedTensor(source.key, torch.empty(box, dtype=self.dtypes[source.key]), shape, offset)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state_dict_of(list(pieces.values())), planner=ShardedLoadPlanner(list(pieces.values())),
                     storage_reader=SafeFileSystemReader(self.path), no_dist=True)
        return {name: piece.data.reshape(piece.data.shape[len(sources[name].index):])
                for name, piece in pieces.items()}


def _check_data_files(path: str, storage: dict) -> None:
    """One line for a data file the index names that is missing or shorter than the bytes it indexes in it (a copy
    or save cut short), before any tensor is read."""
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing: .metadata indexes tensors in it; the torch_dist checkpoint "
                                  f"is incomplete")
        if os.path.getsize(file) < size:
            raise CheckpointError(f"{file} holds {os.path.getsize(file)} bytes where .metadata indexes {size}: the "
                                  f"file was cut short (an interrupted save or copy); copy it again")


def open_checkpoint(path: str) -> tuple[TorchDistCheckpoint | legacy_torch.TorchCheckpoint, int | None]:
    """The reader of the Megatron-LM checkpoint `path` names (a --save directory or one iteration of it), and
    the iteration its directory name or tracker says (None for an oddly named directory)."""
    iteration_dir, iteration = find_iteration(path)
    if _format_of(iteration_dir) == "torch":
        return legacy_torch.TorchCheckpoint(iteration_dir), iteration
    return TorchDistCheckpoint(iteration_dir), iteration


def saved_args(reader, source: str):
    """The args Namespace (or dict) the checkpoint's pickle holds; its absence is one line."""
    args = reader.saved.get("args")
    if args is None:
        raise CheckpointError(f"{source} saved no args (its Megatron flags); it cannot be converted without them")
    return args


def read_in_units(reader, units: Iterable[dict[str, Source]]):
    """Each unit's tensors (our names), read when the unit comes."""
    for unit in units:
        yield reader.read(unit)
