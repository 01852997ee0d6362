"""The megatron_lite side of conversion: checkpoints that hold model weights only, written and read a part
at a time.

An imported model is written as an ordinary checkpoint (checkpoint/checkpointing.py): iteration 0 of
`DIR/iter_0000000/`, a torch.distributed.checkpoint directory of global tensors under global names with
the unpadded vocabulary, plus metadata.json. It has no optimizer or RNG state, so a training run starts
from it with `--load DIR --finetune` (or `--no-load-optim`), in any layout: each rank reads its own boxes.
The tensors come in parts (a layer at a time), each written before the next is made
(checkpoint_parts.py says how one DCP directory is written by several saves).
Reading goes the other way for export and generation: `ModelCheckpoint` gives the names, shapes and dtypes
of any checkpoint's model tensors from its index and reads the ones asked for, whole, in one process; the
configuration the run saved comes from metadata.json beside them.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import warnings
from collections.abc import Iterable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_lite.checkpoint import checksums, directory
from megatron_lite.checkpoint.checkpointing import FORMAT
from megatron_lite.checkpoint.planner import SafeFileSystemReader, ShardedLoadPlanner, state_dict_of
from megatron_lite.checkpoint.sharded import ShardedTensor
from megatron_lite.config.flag_dependencies import acting_flags
from megatron_lite.config.hybrid_layer_pattern import pattern_without_stages
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.hf.checkpoint_parts import PartsWriter
from megatron_lite.hf.configs import ConversionError
from megatron_lite.model.sharding import load_global_tensors
from megatron_lite.parallel.state import TensorSplit

MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
CONVERTED_RNG_LAYOUT = "none (converted checkpoint)"  # never equals a run's layout: no RNG state to restore
# Model fields that are choices of a run rather than properties of the weights: left out of model.yaml.
_RUN_CHOICES = {"model_preset", "recompute_granularity", "recompute_num_layers", "attention_backend"}


def write_model_checkpoint(root: str, parts: Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]],
                           config: Config, extra: dict, iteration: int = 0, consumed_samples: int = 0,
                           optimizer: dict | None = None) -> str:
    """Commit the tensors (global names, unpadded vocabulary) as `iteration` (with `consumed_samples` trained
    on) of checkpoint directory `root`: `parts` is one dict of them, or an iterable of dicts (e.g. a generator
    converting a layer at a time), each written before the next is asked for. `optimizer` holds the plain
    values of the optimizer state when the parts hold its tensors (`optimizer.state.*`). `extra` joins
    metadata.json (e.g. the source config.json). Returns the iteration directory."""
    if directory.complete_iterations(root):
        raise ConversionError(f"{root} already holds a checkpoint; choose an empty --save-dir")
    written = directory.prepare(root, iteration)
    writer = PartsWriter(written)
    for part in [parts] if isinstance(parts, Mapping) else parts:
        if part:
            writer.save(dict(part))
        del part  # the part's tensors go as soon as the generator lets go of them
    writer.close()
    files = checksums.records_of(written, sorted(os.listdir(written)))  # verified when a run loads it
    p = config.parallel
    metadata = {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
                "optimizer": optimizer or {},
                "layout": {"tp": p.tensor_model_parallel_size, "cp": 1, "dp": 1,
                           "pp": p.pipeline_model_parallel_size, "ep": 1, "vp": None},
                "rng_layout": CONVERTED_RNG_LAYOUT, "config": config.to_dict(),
                "versions": {"torch": torch.__version__, "python": platform.python_version()},
                "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "files": files, **extra}
    return directory.commit(root, iteration, metadata)


def resolve_checkpoint(path: str, iteration: int | None = None) -> str:
    """An iteration directory: `path` itself, or the requested / newest complete iteration under it."""
    if directory.is_complete(path):
        return path
    if iteration is None:
        iteration = directory.latest_iteration(path)
        if iteration is None:
            raise ConversionError(f"no complete megatron_lite checkpoint under {path}")
    resolved = directory.checkpoint_path(path, iteration)
    if not directory.is_complete(resolved):
        raise ConversionError(f"{resolved} is not a complete megatron_lite checkpoint")
    return resolved


def config_from_metadata(saved: dict) -> Config:
    """The run configuration a checkpoint's metadata.json recorded (fields this version lacks are skipped)."""
    config = Config()
    for section, values in saved.get("config", {}).items():
        target = getattr(config, section, None)
        if target is None:
            continue
        known = {f.name for f in dataclasses.fields(target)}
        for name, value in values.items():
            if name in known:
                setattr(target, name, value)
    return config


class ModelCheckpoint:
    """The model tensors (no optimizer or RNG state) of iteration directory `path`: `saved` is its metadata.json,
    `entries` the names, shapes and dtypes from DCP's index (no tensor is read for them), and `read(names)`
    reads just the named tensors, whole."""

    def __init__(self, path: str):
        self.path = path
        self.saved = directory.read_metadata(path)
        stored = SafeFileSystemReader(path).read_metadata()
        self.entries = {key: entry for key, entry in stored.state_dict_metadata.items()
                        if key.startswith(MODEL_KEY_PREFIXES) and isinstance(entry, TensorStorageMetadata)}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {key: tuple(entry.size) for key, entry in self.entries.items()}

    def meta_tensors(self) -> dict[str, torch.Tensor]:
        """Each tensor as a meta tensor of its shape and dtype: what a conversion can plan with before reading."""
        return {key: torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
                for key, entry in self.entries.items()}

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, read whole in this process (DCP reads only their chunks)."""
        names = list(names)
        unknown = [name for name in names if name not in self.entries]
        if unknown:
            raise ConversionError(f"{self.path} holds no model tensor '{unknown[0]}'")
        pieces = [ShardedTensor.whole(name, torch.empty(self.entries[name].size,
                                                        dtype=self.entries[name].properties.dtype))
                  for name in names]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state_dict_of(pieces), planner=ShardedLoadPlanner(pieces),
                     storage_reader=SafeFileSystemReader(self.path), no_dist=True)
        return {piece.key: piece.data for piece in pieces}


def read_model_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """metadata.json and every model tensor (no optimizer or RNG state) of iteration directory `path`."""
    checkpoint = ModelCheckpoint(path)
    return checkpoint.saved, checkpoint.read(checkpoint.entries)


@torch.no_grad()
def load_into_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor], split: TensorSplit) -> None:
    """Copy this rank's shard of each global tensor into `model` (parameters and checkpointed buffers), padding
    vocabulary tables to the model's rows."""
    padded = dict(tensors)
    for name, param in model.named_global_parameters():
        rows = param.spec.global_shape[0]
        if param.spec.valid_rows is not None and name in padded and padded[name].shape[0] < rows:
            table = padded[name]
            padded[name] = torch.cat([table, table.new_zeros(rows - table.shape[0], *table.shape[1:])])
    load_global_tensors(model.named_global_parameters(), padded, split)
    load_global_tensors(model.named_global_buffers(), padded, split)


def model_flags(m: ModelConfig) -> dict:
    """pretrain_gpt.py model flags (YAML keys for --config) that rebuild this network: those that act in it (a
    flag that would not, such as the MLA sizes of a Llama, is refused on the command line)."""
    names = [f.name for f in dataclasses.fields(m) if f.name not in _RUN_CHOICES]
    flags = {name: getattr(m, name) for name in acting_flags(Config(model=m), names)}
    switched_off = [f.name for f in dataclasses.fields(m) if f.default is True and getattr(m, f.name) is False]
    if m.hybrid_layer_pattern is not None:  # the network, without the stages of the run that saved it
        flags["hybrid_layer_pattern"] = pattern_without_stages(m.hybrid_layer_pattern)
    return {**flags, **dict.fromkeys(switched_off, False)}  # --no-<flag>, which acting_flags counts as not given
