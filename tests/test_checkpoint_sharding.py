"""Boxes of global tensors: every layout's pieces tile the global tensor, and DCP reshards between them."""

import itertools
import math
import random

import pytest
import torch

from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors
from megatron_lite.checkpoint.planner import ShardedLoadPlanner, ShardedSavePlanner, state_dict_of
from megatron_lite.checkpoint.sharded import ShardedTensor, flat_range_boxes, local_shape, shard_boxes
from megatron_lite.model.sharding import ShardSpec, shard

SPECS = {
    "column": ShardSpec((8, 6), tp_dim=0),
    "swiglu_fc1": ShardSpec((16, 6), tp_dim=0, tp_chunks=2),
    "row": ShardSpec((6, 8), tp_dim=1),
    "replicated": ShardSpec((6,)),
    "vocab": ShardSpec((16, 4), tp_dim=0, valid_rows=11),  # 5 padding rows, some on the last TP rank only
}


def _global(spec: ShardSpec) -> torch.Tensor:
    full = torch.arange(math.prod(spec.global_shape), dtype=torch.float32).view(spec.global_shape) + 1
    if spec.valid_rows is not None:
        full[spec.valid_rows:] = 0
    return full


def _flat_ranges(numel: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    cuts = sorted(rng.sample(range(1, numel), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, numel]
    return list(itertools.pairwise(bounds))


@pytest.mark.parametrize("shape", [(7,), (4, 5), (3, 4, 5)])
def test_flat_range_boxes_tile_the_range_in_row_major_order(shape):
    numel, rng = math.prod(shape), random.Random(0)
    for _ in range(30):
        start = rng.randrange(numel)
        stop = rng.randrange(start + 1, numel + 1)
        covered = torch.zeros(shape, dtype=torch.int64)
        position = start
        for offset, size in flat_range_boxes(shape, start, stop):
            box = covered[tuple(slice(o, o + s) for o, s in zip(offset, size))]
            box += 1
            first = sum(o * math.prod(shape[d + 1:]) for d, o in enumerate(offset))
            assert first == position, "boxes follow each other in memory"
            position += math.prod(size)
        expected = torch.zeros(numel, dtype=torch.int64)
        expected[start:stop] = 1
        assert torch.equal(covered.view(-1), expected)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dp_shards", [1, 3])
def test_every_layouts_boxes_assemble_the_unpadded_global_tensor(name, tp, dp_shards):
    spec = SPECS[name]
    full = _global(spec)
    stored = full[:spec.valid_rows] if spec.valid_rows is not None else full
    assembled, hits = torch.zeros_like(stored), torch.zeros_like(stored)
    rng = random.Random(tp * 10 + dp_shards)
    for tp_rank in range(tp):
        local = shard(full, spec, tp_rank, tp)
        assert tuple(local.shape) == local_shape(spec, tp)
        flat = local.reshape(-1)
        for start, stop in _flat_ranges(flat.numel(), dp_shards, rng):  # a distributed optimizer's split
            ranged = None if dp_shards == 1 else (start, stop)
            data = local if ranged is None else flat[start:stop]
            for piece in shard_boxes("w", spec, tp_rank, tp, data, ranged):
                assert piece.global_shape == tuple(stored.shape)
                index = tuple(slice(o, o + s) for o, s in zip(piece.global_offset, piece.data.shape))
                assembled[index] = piece.data
                hits[index] += 1
    assert torch.equal(assembled, stored)
    replicas = tp if spec.tp_dim is None else 1
    assert torch.all(hits == replicas), "each element is held exactly once per replica"


def _layout_pieces(tensors: dict, tp: int, dp_shards: int, live: bool) -> list[ShardedTensor]:
    """Every rank's boxes of `tensors` in a TP x (distributed-optimizer) DP layout, replicas held once."""
    pieces, rng = [], random.Random(tp + dp_shards)
    for key, full in tensors.items():
        spec = SPECS[key]
        for tp_rank in range(tp if spec.tp_dim is not None else 1):
            local = shard(full, spec, tp_rank, tp).clone()
            if not live:
                local.zero_()
            for start, stop in _flat_ranges(local.numel(), dp_shards, rng):
                ranged = None if dp_shards == 1 else (start, stop)
                data = local if ranged is None else local.view(-1)[start:stop]
                pieces += shard_boxes(key, spec, tp_rank, tp, data, ranged)
    return pieces


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_saved_in_one_tp_and_zero_split_loads_in_another(tmp_path):
    import torch.distributed.checkpoint as dcp

    tensors = {name: _global(spec) for name, spec in SPECS.items()}
    saved = _layout_pieces(tensors, tp=2, dp_shards=3, live=True)
    dcp.save(state_dict_of(saved), storage_writer=dcp.FileSystemWriter(str(tmp_path)),
             planner=ShardedSavePlanner(saved), no_dist=True)
    for tp, dp_shards in ((1, 1), (4, 1), (4, 2)):
        targets = _layout_pieces(tensors, tp, dp_shards, live=False)
        assert all(not p.data.any() for p in targets)
        dcp.load(state_dict_of(targets), storage_reader=dcp.FileSystemReader(str(tmp_path)),
                 planner=ShardedLoadPlanner(targets), no_dist=True)
        for piece in targets:
            full = tensors[piece.key]
            index = tuple(slice(o, o + s) for o, s in zip(piece.global_offset, piece.data.shape))
            assert torch.equal(piece.data, full[index]), (piece.key, tp, dp_shards)
    whole = read_checkpoint_tensors(str(tmp_path))
    assert torch.equal(whole["vocab"], tensors["vocab"][:11])
    assert torch.equal(whole["swiglu_fc1"], tensors["swiglu_fc1"])
