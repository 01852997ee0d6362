"""Megatron-LM's older `torch` checkpoint format: one `model_optim_rng.pt` per tensor and pipeline rank.

    iter_0000100/mp_rank_00/model_optim_rng.pt          TP rank 0 (no pipeline parallelism)
    iter_0000100/mp_rank_01_002/model_optim_rng.pt      TP rank 1 of pipeline stage 2

Each file holds its rank's shards under local names (the stage's layers numbered from 0). A tensor is made
global by joining the TP ranks' shards: along rows for column-parallel weights (QKV, fc1, the vocabulary
tables), along columns for row-parallel ones (the attention projection, fc2); SwiGLU's fc1 shards are each
[gate_r; up_r], so the gates are joined and then the ups. Everything else is replicated over TP and must be
equal on every rank. A stage's layers follow the previous stages' (counted from their files). Files are
opened memory-mapped, so shapes are known without reading, and a stage's tensors are joined when a layer of
it is first asked for, one stage held at a time.
"""

from __future__ import annotations

import os
import re

import torch

from megatron_lite.errors import CheckpointError
from megatron_lite.megatron_lm.names import Source, is_extra_state
from megatron_lite.megatron_lm.pickles import load_megatron_pickle

RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_FILE = "model_optim_rng.pt"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "linear_fc1.weight",
                    "linear_fc1.bias", "embedding.word_embeddings.weight", "output_layer.weight")
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "linear_fc2.weight")
_GATED = ("linear_fc1.weight", "linear_fc1.bias")


class TorchCheckpoint:
    """One iteration saved with --ckpt-format torch (tensor and pipeline parallel; no expert parallelism)."""

    format = "torch"

    def __init__(self, path: str):
        self.path = path
        ranks = {}
        for name in os.listdir(path):
            match = RANK_DIR.match(name)
            if match:
                if match.group(3) is not None:
                    raise CheckpointError(f"{path}/{name}: torch-format checkpoints with expert parallelism are "
                                          f"not read; save it with --ckpt-format torch_dist in Megatron-LM")
                ranks[(int(match.group(1)), int(match.group(2) or 0))] = os.path.join(path, name, _FILE)
        self.tp = 1 + max(tp for tp, _ in ranks)
        self.pp = 1 + max(pp for _, pp in ranks)
        missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if self.pp > 1 else "")
                   for t in range(self.tp) for p in range(self.pp) if (t, p) not in ranks]
        if missing:
            raise CheckpointError(f"{path} has no {missing[0]}/{_FILE}: the torch-format checkpoint is incomplete")
        self.files = {rank: load_megatron_pickle(file, mmap=True) for rank, file in sorted(ranks.items())}
        self.saved = {key: value for key, value in self.files[(0, 0)].items() if key not in ("model", "optimizer")}
        if "model" not in self.files[(0, 0)]:
            keys = sorted(k for k in self.files[(0, 0)] if k.startswith("model"))
            raise CheckpointError(f"{path}: its files hold {keys or 'no model'}, not one 'model' (virtual pipeline "
                                  f"stages are not read from the torch format; use torch_dist)")
        args = self.saved.get("args")
        self.gated = bool(getattr(args, "swiglu", False))
        self.layer_offsets = self._layer_offsets()
        self.shapes = {}
        for stage in range(self.pp):
            for key, shards in self._stage_shards(stage).items():
                self.shapes[key] = tuple(_joined_shape(key, [shard.shape for shard in shards]))
        self._stage, self._joined = None, {}

    def model_keys(self) -> list[str]:
        return list(self.shapes)

    def _layer_offsets(self) -> list[int]:
        """The global number of each stage's first layer: the layers of the stages before it."""
        offsets, total = [], 0
        for stage in range(self.pp):
            offsets.append(total)
            layers = {int(m.group(1)) for key in self.files[(0, stage)]["model"] if (m := _LAYER.match(key))}
            total += len(layers)
        return offsets

    def _stage_shards(self, stage: int) -> dict[str, list[torch.Tensor]]:
        """{global Megatron key: [the shard of each TP rank]} of one pipeline stage's model tensors."""
        shards = {}
        for tp in range(self.tp):
            for key, tensor in self.files[(tp, stage)]["model"].items():
                if is_extra_state(key) or not isinstance(tensor, torch.Tensor):
                    continue
                shards.setdefault(self._global_key(key, stage), []).append(tensor)
        return shards

    def _global_key(self, key: str, stage: int) -> str:
        match = _LAYER.match(key)
        if not match:
            return key
        layer, rest = int(match.group(1)) + self.layer_offsets[stage], match.group(2)
        return f"decoder.layers.{layer}.{rest}"

    def read(self, sources: dict[str, Source]) -> dict[str, torch.Tensor]:
        """Our tensors, by name, from the stage holding each (the stage's shards joined once, when first asked)."""
        found = {}
        for name, source in sources.items():
            stage = self._stage_of(source.key)
            if stage != self._stage:
                self._stage = stage
                self._joined = {key: _join(key, shards, self.gated, self.path)
                                for key, shards in self._stage_shards(stage).items()}
            found[name] = self._joined[source.key]
        return found

    def _stage_of(self, key: str) -> int:
        match = _LAYER.match(key)
        if match is None:
            return 0 if key.startswith("embedding.") else self.pp - 1
        layer = int(match.group(1))
        return max(stage for stage, offset in enumerate(self.layer_offsets) if offset <= layer)


def _kind(key: str) -> str:
    if key.endswith(_COLUMN_PARALLEL):
        return "column"
    if key.endswith(_ROW_PARALLEL):
        return "row"
    return "replicated"


def _joined_shape(key: str, shapes: list[torch.Size]) -> list[int]:
    shape = list(shapes[0])
    kind = _kind(key)
    if kind != "replicated":
        shape[0 if kind == "column" else 1] *= len(shapes)
    return shape


def _join(key: str, shards: list[torch.Tensor], gated: bool, path: str) -> torch.Tensor:
    """The global tensor from the TP ranks' shards."""
    kind = _kind(key)
    if kind == "row":
        return torch.cat(shards, dim=1)
    if kind == "column":
        if gated and key.endswith(_GATED):
            gates, ups = zip(*(shard.chunk(2) for shard in shards))
            return torch.cat([*gates, *ups])
        return torch.cat(shards)
    if any(not torch.equal(shard, shards[0]) for shard in shards[1:]):
        raise CheckpointError(f"{path}: '{key}' differs between tensor-parallel ranks, so it is not a replicated "
                              f"tensor this reader knows how to join")
    return shards[0]

