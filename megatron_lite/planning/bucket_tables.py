"""A model chunk's gradient buckets as optim/param_and_grad_buffer.py cuts them, and their padded sums.

Parameters of one kind (dense, or routed expert) are taken in backward order (`module.parameters()` reversed) and
cut into buckets of about --ddp-bucket-size elements, a new bucket around each isolated parameter (the tied
embedding copy) and, under ZeRO-3, at every gathering unit's boundary; each bucket is padded to a multiple of the
group it is reduced over (dense: dp x cp of one distributed-optimizer instance; experts: the expert data-parallel
ranks of one instance) and split into equal shards, one per rank of that group.

The cut depends on the model, tp, ep, etp, the bucket size and whether ZeRO-3 cuts at units, never on the
data-parallel sizes: a ChunkTable holds it once as arrays and computes the padded sums for any group sizes and
shard with array arithmetic. Under ZeRO-3 each layer is cut on its own, so a layer's cut is computed once per
layer kind. Inside shared_cache.shared_results (the planner's enumeration of thousands of layouts) one table
serves every layout holding the same chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_lite.config.layer_split import ChunkPlan
from megatron_lite.config.sections import Config
from megatron_lite.optim.zero_stage import ZeroStage
from megatron_lite.planning.param_shapes import (
    ParamShape,
    back_params,
    chunk_layer_specs,
    chunk_params,
    front_params,
    layer_numels,
)
from megatron_lite.planning.shared_cache import shapes_key, shared


def cut_points(numels: list[int], isolated: list[bool], units: list[int], bucket_size: int,
               zero3: bool) -> list[int]:
    """Where buckets start in a run of parameters in backward order (indices, the first 0; none for no
    parameters): a new bucket once the current one holds bucket_size elements, around each isolated parameter,
    and under ZeRO-3 at each change of unit."""
    starts, size = [], 0
    for index, numel in enumerate(numels):
        if index == 0 or (size >= bucket_size or isolated[index] or isolated[index - 1]
                          or (zero3 and units[index] != units[index - 1])):
            starts.append(index)
            size = 0
        size += numel
    return starts


def param_buckets(config: Config, chunk: ChunkPlan) -> list[tuple[bool, list[ParamShape]]]:
    """Each bucket of one model chunk as (expert, its parameters in buffer order), in backward order, dense
    ones first."""
    params = chunk_params(config, chunk)
    zero3 = _cuts_at_units(config)
    buckets = []
    for expert in (False, True):
        members = [param for param in params if param.expert == expert][::-1]
        starts = cut_points([param.numel for param in members], [param.isolated for param in members],
                            [param.unit for param in members], config.parallel.ddp_bucket_size, zero3)
        buckets += [(expert, members[start:stop]) for start, stop in zip(starts, starts[1:] + [len(members)])]
    return buckets


def _cuts_at_units(config: Config) -> bool:
    return ZeroStage(config.parallel.data_parallel_sharding_strategy).shards_params


def _bucket_sizes(numels: list[int], starts: list[int]) -> list[int]:
    return [sum(numels[start:stop]) for start, stop in zip(starts, starts[1:] + [len(numels)])]


@dataclass(frozen=True)
class _Run:
    """Consecutive parameters of one kind and one ZeRO-3 unit, in backward order."""

    expert: bool
    unit: int
    numels: list[int]
    isolated: list[bool]


def _runs(config: Config, chunk: ChunkPlan) -> list[_Run]:
    """The chunk's parameters as runs, in backward order, dense ones first: the chunk's own parameters after its
    layers (final norm, output layer, multi-token prediction), each layer's (last layer first), those before its
    layers; then the routed experts', in the same order. The runs of one layer spec share their lists."""
    specs = chunk_layer_specs(config, chunk)
    per_spec = {}
    for spec in set(specs):
        dense, expert = layer_numels(config, spec)
        per_spec[spec] = ((dense[::-1], [False] * len(dense)), (expert[::-1], [False] * len(expert)))
    back, front = back_params(config, chunk)[::-1], front_params(config, chunk)[::-1]
    if not specs:  # no layer between them: one unit
        back, front = back + front, []
    runs = []
    for expert in (False, True):
        ends = [[param for param in params if param.expert == expert] for params in (back, front)]
        ends = [_Run(expert, -1, [param.numel for param in params], [param.isolated for param in params])
                for params in ends]
        layers = [_Run(expert, index, *per_spec[specs[index]][expert]) for index in reversed(range(chunk.num_layers))]
        runs += [ends[0], *layers, ends[1]]
    return runs


@dataclass(frozen=True)
class BucketSums:
    """A chunk's buckets summed for one pair of group sizes and one rank's shards: padded elements, the rank's
    shards, and the elements of them inside real parameters (what its optimizer steps under a sharded strategy)."""

    padded: int
    shards: int
    owned: int


class ChunkTable:
    """One model chunk's parameter elements and bucket cut (arrays of each bucket's elements, kind and ZeRO-3
    unit, in backward order, dense buckets first), and their sums per group sizes and shard."""

    def __init__(self, config: Config, chunk: ChunkPlan):
        bucket_size = config.parallel.ddp_bucket_size
        runs = _runs(config, chunk)
        sizes, experts, units = [], [], []
        if _cuts_at_units(config):  # ZeRO-3: each run is cut on its own, each layer kind's run once
            cut_of: dict[int, list[int]] = {}
            for run in runs:
                if id(run.numels) not in cut_of:
                    cut_of[id(run.numels)] = _bucket_sizes(run.numels, cut_points(
                        run.numels, run.isolated, [run.unit] * len(run.numels), bucket_size, False))
                run_sizes = cut_of[id(run.numels)]
                sizes += run_sizes
                experts += [run.expert] * len(run_sizes)
                units += [run.unit] * len(run_sizes)
        else:  # a kind's runs cut as one sequence
            for expert in (False, True):
                kind = [run for run in runs if run.expert == expert]
                numels = [numel for run in kind for numel in run.numels]
                run_units = [run.unit for run in kind for _ in run.numels]
                starts = cut_points(numels, [flag for run in kind for flag in run.isolated], run_units, bucket_size,
                                    False)
                sizes += _bucket_sizes(numels, starts)
                experts += [expert] * len(starts)
                units += [run_units[start] for start in starts]
        self.sizes = np.array(sizes, dtype=np.int64)
        self.expert = np.array(experts, dtype=bool)
        self.units = np.array(units, dtype=np.int64)
        self.numel = int(self.sizes.sum())
        self.expert_numel = int(self.sizes[self.expert].sum())
        self._padded: dict[tuple[int, int], np.ndarray] = {}
        self._sums: dict[tuple, BucketSums] = {}
        self._zero_buffers: dict[tuple, tuple[int, int, int]] = {}

    def padded(self, groups: tuple[int, int]) -> np.ndarray:
        """Each bucket's elements padded to a multiple of its group, `groups` = (dense, expert) ranks."""
        if groups not in self._padded:
            group = np.where(self.expert, groups[1], groups[0])
            self._padded[groups] = -(-self.sizes // group) * group
        return self._padded[groups]

    def sums(self, groups: tuple[int, int], indices: tuple[int, int]) -> BucketSums:
        """The buckets' sums for a rank at shard `indices` (dense, expert) of groups of `groups` ranks."""
        key = (groups, indices)
        if key not in self._sums:
            padded = self.padded(groups)
            shards = padded // np.where(self.expert, groups[1], groups[0])
            starts = np.where(self.expert, indices[1], indices[0]) * shards  # the parameters tile [0, size)
            owned = np.maximum(np.minimum(starts + shards, self.sizes) - starts, 0)
            self._sums[key] = BucketSums(int(padded.sum()), int(shards.sum()), int(owned.sum()))
        return self._sums[key]

    def zero_buffers(self, groups: tuple[int, int], layers_gathered: int) -> tuple[int, int, int]:
        """Elements of ZeRO-2/3's temporary buffers (activation_memory._zero_buffers): the largest dense bucket plus
        every expert bucket (gradients summed before their reduce-scatter), the chunk's own unit, and its
        `layers_gathered` largest layer units (parameters gathered around their use)."""
        key = (groups, layers_gathered)
        if key not in self._zero_buffers:
            padded = self.padded(groups)
            grads = int(padded[~self.expert].max(initial=0)) + int(padded[self.expert].sum())
            per_unit = np.bincount(self.units + 1, weights=padded.astype(np.float64), minlength=1)  # exact < 2**53
            layers = int(np.sort(per_unit[1:])[::-1][:layers_gathered].sum())
            self._zero_buffers[key] = grads, int(per_unit[0]), layers
        return self._zero_buffers[key]


def chunk_table(config: Config, chunk: ChunkPlan) -> ChunkTable:
    """The chunk's table, shared by the layouts holding the same chunk (shared_cache)."""
    key = ("chunk table", shapes_key(config), config.parallel.ddp_bucket_size, _cuts_at_units(config),
           chunk.layer_offset, chunk.num_layers, chunk.pre_process, chunk.post_process)
    return shared(key, lambda: ChunkTable(config, chunk))
