"""Sharded state: each rank's pieces of the global tensors, with their global placement.

A checkpoint is a set of global tensors keyed by layout-independent names (`decoder.layers.7.mlp.fc1.weight`,
`optimizer.state.exp_avg.<name>`). A rank contributes `ShardedTensor`s: a view of the data it holds plus
the global shape and the offset of that box in the global tensor. One rank may hold several boxes of one
tensor: SwiGLU's fused fc1 keeps [gate_r; up_r], two boxes of the global [gate; up]; a distributed-optimizer
shard is a flat range of the TP shard, a few row-major boxes. Storage (checkpoint/planner.py) writes every
box once however many ranks hold it, and a rank of any other layout reads back exactly the boxes it holds.

Vocabulary tables are stored without their padding rows (`ShardSpec.valid_rows`), since the padding
depends on the TP size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_lite.model.sharding import ShardSpec


@dataclass
class ShardedTensor:
    """A box of a global tensor held by this rank. `data` is a view of the live tensor: saving reads it,
    loading writes into it."""

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    @classmethod
    def whole(cls, key: str, data: torch.Tensor) -> ShardedTensor:
        """A tensor this rank holds whole (a scalar, or a per-rank tensor under a rank-unique key)."""
        return cls(key, data, tuple(data.shape), (0,) * data.dim())


def local_shape(spec: ShardSpec, tp_size: int) -> tuple[int, ...]:
    """Shape of a TP rank's shard of a parameter described by `spec`."""
    shape = list(spec.global_shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= tp_size
    return tuple(shape)


def stored_shape(spec: ShardSpec) -> tuple[int, ...]:
    """Global shape as stored: vocabulary padding rows dropped."""
    if spec.valid_rows is None:
        return tuple(spec.global_shape)
    return (spec.valid_rows, *spec.global_shape[1:])


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Row-major elements [start, stop) of a tensor of `shape` as boxes (offset, size), each contiguous in
    memory: a partial first row, whole rows, a partial last row (recursively for the inner dimensions)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    boxes = []
    row, position = divmod(start, inner)
    if position:  # partial first row
        end = min(stop, (row + 1) * inner)
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], position, end - row * inner)]
        start, row = end, row + 1
    whole_rows = (stop - start) // inner
    if whole_rows:
        boxes.append(((row, *[0] * (len(shape) - 1)), (whole_rows, *shape[1:])))
        start, row = start + whole_rows * inner, row + whole_rows
    if start < stop:  # partial last row
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, stop - start)]
    return boxes


def _tp_segments(spec: ShardSpec, tp_rank: int, tp_size: int, shape: tuple[int, ...], start: int, size: int):
    """Split local indices [start, start + size) along the TP dimension into (local start, length, global
    start) runs: a fused tensor of tp_chunks parts maps each part to a different global region."""
    if spec.tp_dim is None or tp_size == 1:
        return [(start, size, start)]
    local_chunk = shape[spec.tp_dim] // spec.tp_chunks
    global_chunk = spec.global_shape[spec.tp_dim] // spec.tp_chunks
    runs, stop = [], start + size
    while start < stop:
        part, within = divmod(start, local_chunk)
        end = min(stop, (part + 1) * local_chunk)
        runs.append((start, end - start, part * global_chunk + tp_rank * local_chunk + within))
        start = end
    return runs


def shard_boxes(key: str, spec: ShardSpec, tp_rank: int, tp_size: int, data: torch.Tensor,
                flat_range: tuple[int, int] | None = None) -> list[ShardedTensor]:
    """The boxes of global tensor `key` that this rank holds, as views of `data`.

    `data` is this TP rank's shard (shape `local_shape(spec, tp_size)`), or, with `flat_range=(start,
    stop)`, a 1-D tensor holding elements [start, stop) of that shard flattened row-major (a
    distributed-optimizer shard).
    """
    shape = local_shape(spec, tp_size)
    if flat_range is None:
        boxes = [(data, (0,) * len(shape))]
    else:
        boxes = [(data[_ravel(offset, shape) - flat_range[0]:][:math.prod(size)].view(size), offset)
                 for offset, size in flat_range_boxes(shape, *flat_range)]
    global_shape = stored_shape(spec)
    if not shape:
        return [ShardedTensor(key, box, global_shape, ()) for box, _ in boxes]
    dim = spec.tp_dim if spec.tp_dim is not None else 0
    pieces = []
    for box, offset in boxes:
        for local_start, length, global_start in _tp_segments(spec, tp_rank, tp_size, shape, offset[dim],
                                                              box.shape[dim]):
            piece = box.narrow(dim, local_start - offset[dim], length)
            global_offset = list(offset)
            global_offset[dim] = global_start
            if spec.valid_rows is not None:  # drop vocabulary padding rows (dim 0)
                rows = min(piece.shape[0], spec.valid_rows - global_offset[0])
                if rows <= 0:
                    continue
                piece = piece.narrow(0, 0, rows)
            pieces.append(ShardedTensor(key, piece, global_shape, tuple(global_offset)))
    return pieces


def _ravel(offset: tuple[int, ...], shape: tuple[int, ...]) -> int:
    index = 0
    for o, s in zip(offset, shape):
        index = index * s + o
    return index
