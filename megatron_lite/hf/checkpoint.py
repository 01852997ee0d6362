"""The megatron_lite side of conversion: checkpoints that hold model weights only, written and read whole.

An imported model is written as an ordinary checkpoint (checkpoint/checkpointing.py): iteration 0 of
`DIR/iter_0000000/`, a torch.distributed.checkpoint directory of global tensors under global names with
the unpadded vocabulary, plus metadata.json. It has no optimizer or RNG state, so a training run starts
from it with `--load DIR --finetune` (or `--no-load-optim`), in any layout: each rank reads its own boxes.
Reading goes the other way for export and generation: the model tensors of any checkpoint, whole, in one
process, and the configuration the run saved beside them.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import warnings

import torch
import torch.distributed.checkpoint as dcp

from megatron_lite.checkpoint import checksums, directory
from megatron_lite.checkpoint.checkpointing import FORMAT, read_checkpoint_tensors
from megatron_lite.checkpoint.planner import ShardedSavePlanner, state_dict_of
from megatron_lite.checkpoint.sharded import ShardedTensor
from megatron_lite.config import Config, ModelConfig
from megatron_lite.hf.configs import ConversionError
from megatron_lite.model.sharding import load_global_tensors
from megatron_lite.parallel.state import TensorSplit

MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.", "mtp.")
CONVERTED_RNG_LAYOUT = "none (converted checkpoint)"  # never equals a run's layout: no RNG state to restore
# Model fields that are choices of a run rather than properties of the weights: left out of model.yaml.
_RUN_CHOICES = {"model_preset", "recompute_granularity", "recompute_num_layers", "attention_backend"}


def write_model_checkpoint(root: str, tensors: dict[str, torch.Tensor], config: Config, extra: dict) -> str:
    """Commit `tensors` (global names, unpadded vocabulary) as iteration 0 of checkpoint directory `root`;
    `extra` joins metadata.json (e.g. the source config.json). Returns the iteration directory."""
    if directory.complete_iterations(root):
        raise ConversionError(f"{root} already holds a checkpoint; choose an empty --save-dir")
    pieces = [ShardedTensor.whole(name, tensor.contiguous()) for name, tensor in tensors.items()]
    directory.prepare(root, 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        # Several writer threads overlap serializing and writing: 1.8x faster for a 1.2B model on 2 cores.
        writer = dcp.FileSystemWriter(directory.temporary_path(root, 0), thread_count=4)
        dcp.save(state_dict_of(pieces), planner=ShardedSavePlanner(pieces), storage_writer=writer, no_dist=True)
    written = directory.temporary_path(root, 0)
    files = checksums.records_of(written, sorted(os.listdir(written)))  # verified when a run loads it
    p = config.parallel
    metadata = {"format": FORMAT, "iteration": 0, "consumed_samples": 0, "optimizer": {},
                "layout": {"tp": p.tensor_model_parallel_size, "cp": 1, "dp": 1,
                           "pp": p.pipeline_model_parallel_size, "ep": 1, "vp": None},
                "rng_layout": CONVERTED_RNG_LAYOUT, "config": config.to_dict(),
                "versions": {"torch": torch.__version__, "python": platform.python_version()},
                "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "files": files, **extra}
    return directory.commit(root, 0, metadata)


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


def read_model_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """metadata.json and every model tensor (no optimizer or RNG state) of iteration directory `path`."""
    saved = directory.read_metadata(path)
    tensors = {}
    for prefix in MODEL_KEY_PREFIXES:
        tensors.update(read_checkpoint_tensors(path, prefix))
    return saved, tensors


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
    """pretrain_gpt.py model flags (YAML keys for --config) that rebuild this network."""
    return {f.name: getattr(m, f.name) for f in dataclasses.fields(m)
            if f.name not in _RUN_CHOICES and getattr(m, f.name) is not None
            and (m.num_experts or not f.name.startswith("moe_"))}
