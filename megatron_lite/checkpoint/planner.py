"""torch.distributed.checkpoint (DCP) glue: save and load lists of ShardedTensor boxes, and read safely.

DCP writes one file per rank plus a `.metadata` index of every global tensor's chunks. Its default
planners take a state dict of whole tensors, DTensors or torch ShardedTensors; ours take the boxes of
checkpoint/sharded.py directly, so a rank may hold any number of boxes of one global tensor at any
offsets (SwiGLU halves, distributed-optimizer flat ranges) without building a device mesh.

Save: each box becomes one write item indexed by (key, global offset). A box several ranks hold
(data-parallel replicas, TP-replicated norms, the last stage's copy of tied embeddings) is written by one
of them: `boxes_to_write` picks it before anything is copied, so an asynchronous save stages only what
this rank writes (DCP's own deduplication then finds nothing left to drop). DCP's coordinator refuses a
plan whose boxes overlap or leave a gap. Load: each box reads the overlapping parts of the
stored chunks, whatever layout wrote them.

Safety: DCP unpickles `.metadata` with plain `pickle` and byte items with `torch.load(weights_only=False)`.
`SafeFileSystemReader` reads `.metadata` with an unpickler that only builds DCP's metadata classes, and the
load planner refuses byte items; tensors are read by DCP with `torch.load(weights_only=True)`. A crafted
checkpoint therefore fails to load instead of running code.

Checksums: `RecordingFileSystemWriter` keeps the names of the data files this rank wrote. The Metadata that
`dcp.save` returns names them only in some torch versions (2.11 fills in a copy of it), so the writer's own
results are the record.
"""

from __future__ import annotations

import pickle
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, Metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_lite.checkpoint.sharded import ShardedTensor
from megatron_lite.errors import CheckpointError


def _index(piece: ShardedTensor) -> tuple[str, tuple[int, ...]]:
    return piece.key, tuple(piece.global_offset)


def state_dict_of(pieces: list[ShardedTensor]) -> dict[str, torch.Tensor]:
    """The flat dict DCP's save/load/async-save entry points pass around: one entry per box."""
    return {f"{p.key}@{','.join(map(str, p.global_offset))}": p.data for p in pieces}


def boxes_to_write(pieces: list[ShardedTensor], group) -> list[ShardedTensor]:
    """The boxes this rank writes. Every rank sees every rank's box list (one all-gather) and runs the same
    deterministic assignment: biggest boxes first, each to the least-loaded of the ranks holding it, so
    replicas are written once and the bytes spread evenly over the ranks."""
    if group is None:
        return pieces
    mine = [(p.key, tuple(p.global_offset), p.data.numel() * p.data.element_size()) for p in pieces]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    holders, sizes = defaultdict(list), {}
    for rank, boxes in enumerate(everyone):
        for key, offset, nbytes in boxes:
            holders[(key, offset)].append(rank)
            sizes[(key, offset)] = nbytes
    written, writer = [0] * len(everyone), {}
    for index in sorted(holders, key=lambda i: (-sizes[i], i)):
        rank = min(holders[index], key=lambda r: (written[r], r))
        writer[index] = rank
        written[rank] += sizes[index]
    me = dist.get_rank(group)
    return [p for p in pieces if writer[_index(p)] == me]


class ShardedSavePlanner(DefaultSavePlanner):
    """Plans one write item per box, at its global offset in its global tensor."""

    def __init__(self, pieces: list[ShardedTensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {_index(p): p for p in pieces}

    def create_local_plan(self) -> SavePlan:
        items = []
        for piece in self.pieces.values():
            data = piece.data
            items.append(WriteItem(
                index=MetadataIndex(piece.key, torch.Size(piece.global_offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(piece.global_offset), sizes=data.shape),
                    properties=TensorProperties.create_from_tensor(data),
                    size=torch.Size(piece.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[(index.fqn, tuple(index.offset))].data


class ShardedLoadPlanner(DefaultLoadPlanner):
    """Reads into each box the parts of the stored chunks it overlaps. Byte (pickled) items are refused."""

    def __init__(self, pieces: list[ShardedTensor]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {_index(p): p for p in pieces}

    def create_local_plan(self) -> LoadPlan:
        problems = missing_or_mismatched(self.pieces.values(), self.metadata)
        if problems:
            raise CheckpointError(problems[0])
        requests = []
        for piece in self.pieces.values():
            chunk = ChunkStorageMetadata(offsets=torch.Size(piece.global_offset), sizes=piece.data.shape)
            requests += create_read_items_for_chunk_list(piece.key, self.metadata.state_dict_metadata[piece.key],
                                                         [chunk])
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[(index.fqn, tuple(index.offset))].data

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn} is a pickled object; refusing to "
                              f"unpickle it (megatron_lite checkpoints hold tensors only)")


def missing_or_mismatched(pieces, metadata: Metadata) -> list[str]:
    """Why the boxes cannot be read from a checkpoint with `metadata` (empty when they can)."""
    problems = []
    for piece in pieces:
        stored = metadata.state_dict_metadata.get(piece.key)
        if stored is None:
            problems.append(f"the checkpoint has no tensor '{piece.key}'")
        elif not isinstance(stored, TensorStorageMetadata):
            problems.append(f"checkpoint entry '{piece.key}' is not a tensor")
        elif tuple(stored.size) != tuple(piece.global_shape):
            problems.append(f"checkpoint tensor '{piece.key}' has global shape {tuple(stored.size)} but this "
                            f"model expects {tuple(piece.global_shape)}")
    return problems


# ---------------------------------------------------------------------------------------------------------
# Reading `.metadata` without running code

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                 "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {  # the cached save plans Megatron-Core's planner keeps in its index (plain dataclasses of torch's)
    ("torch.distributed.checkpoint.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType",
                                                                 "TensorWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.storage", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata classes, torch dtypes and plain containers; anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which a DCP index never holds; "
                              f"refusing to load it")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by the allow-list unpickler above."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as error:
                raise CheckpointError(f"{path} is not a readable DCP index ({type(error).__name__}: {error}); "
                                      f"the checkpoint is damaged") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class RecordingFileSystemWriter(FileSystemWriter):
    """DCP's file writer that keeps `written_files`, the data files it wrote for this rank (relative names)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.written_files: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written_files = sorted({result.storage_data.relative_path for result in future.wait()})
        return future
