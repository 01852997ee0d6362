"""ParallelState: which rank holds which piece of the model, and the process groups between them.

World size = TP x CP x DP x PP with rank order tp-cp-dp-pp, fastest-varying first (Megatron's default),
so a tensor-parallel group sits on adjacent ranks (one node's NVLink) and pipeline stages are furthest
apart. Expert layers regroup the TP x CP x DP ranks of a stage (MoE parallel folding, Megatron's
--expert-tensor-parallel-size): its flat index tp + TP (cp + CP dp) is read as etp-ep-edp, fastest-varying
first, so ETP ranks split each expert's weights, EP ranks hold different experts and the remaining "expert
data parallel" (EDP) ranks hold replicas of the same experts; ETP x EP x EDP = TP x CP x DP. With ETP = TP
(the default) the expert coordinates are tp and a split of the dp x cp index, the layout before folding.

Groups, and what each is for:
  tp          tensor-parallel shards of one layer (all-reduce / all-gather / reduce-scatter activations)
  cp          context-parallel shards of the sequence (ring attention)
  cp_a2a      with hierarchical cp A x B: A consecutive cp ranks that exchange heads by all-to-all
  cp_p2p      with hierarchical cp A x B: the B cp ranks at one place in their a2a groups (K/V ring)
  dp          data-parallel replicas (with cp=1, where non-expert gradients are reduced)
  dp_cp       data x context parallel: where non-expert gradients are reduced
  intra_dp_cp with N distributed-optimizer instances: dp x cp / N consecutive dp_cp ranks (one instance), where
              dense gradients are reduce-scattered and the optimizer and ZeRO-3 parameters sharded
              (the dp_cp group itself when N = 1)
  inter_dist_opt  the N ranks at the same place of their instances: each all-reduces its gradient shard
              with the others (None when N = 1)
  pp          the pipeline stages holding one model replica (send/recv activations)
  embedding   first and last pipeline stage (keeps tied input/output embeddings equal)
  etp         expert-tensor-parallel shards of the routed experts (the tp group itself when ETP = TP)
  ep          expert-parallel ranks that split the experts of one layer (token all-to-all)
  expert_dp   replicas of the same experts (where expert gradients are reduced)
  intra_expert_dp  edp / N consecutive expert_dp ranks: the instance's share of expert_dp, as intra_dp_cp
  model_parallel  tp x pp ranks of one replica
  world       every rank (global norms; None for a single-rank layout)

Distributed-optimizer instances (Megatron's --num-distributed-optimizer-instances, FSDP's hybrid sharding):
instance i holds dp_cp indices [i s, (i + 1) s) with s = dp x cp / N, so it sits on adjacent ranks (one
node) and only the inter-instance all-reduce crosses the slower links. The expert instances are cut the
same way from expert_dp (edp / N consecutive edp indices); their inter-instance groups are the dense ones
(with ETP = TP an expert rank at edp index e and ep index j sits at dp_cp index e ep + j, and e mod
(edp / N) fixes (e ep + j) mod s), so one group serves both, as in Megatron; several instances therefore
need ETP = TP.

The coordinate arithmetic is pure (`rank_coordinates`, `group_ranks`) and unit-tested without any
process group. A `ParallelState` holds the groups for one layout; it is passed to whatever needs it,
so one process can build several layouts (the tests compare a parallel layout with a single-device
one in the same process).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism. `dp` is the data-parallel size of the dense (non-expert) layers;
    `etp` is the expert-tensor-parallel size (None: tp, Megatron's default); `hierarchical_cp` (A, B) splits
    cp = A x B into a2a groups of A consecutive cp ranks and p2p groups across them
    (--hierarchical-context-parallel-sizes); `dist_opt_instances` N cuts the dp x cp (and expert dp) ranks into
    N distributed-optimizer instances (--num-distributed-optimizer-instances)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    hierarchical_cp: tuple[int, int] | None = None
    dist_opt_instances: int = 1

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("tp", "cp", "dp", "pp", "ep", "etp", "dist_opt_instances"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} size must be at least 1, got {getattr(self, name)}")
        if self.stage_size % (self.etp * self.ep):
            raise ValueError(f"expert-tensor-parallel-size x expert-model-parallel-size ({self.etp} x {self.ep}) "
                             f"must divide tensor x context x data-parallel size "
                             f"({self.tp} x {self.cp} x {self.dp})")
        if self.dist_opt_instances > 1 and self.etp != self.tp:
            raise ValueError(f"num-distributed-optimizer-instances ({self.dist_opt_instances}) > 1 needs "
                             f"expert-tensor-parallel-size ({self.etp}) equal to tensor-model-parallel-size "
                             f"({self.tp})")
        if self.hierarchical_cp is not None and self.hierarchical_cp[0] * self.hierarchical_cp[1] != self.cp:
            raise ValueError(f"hierarchical-context-parallel-sizes {self.hierarchical_cp} must multiply to "
                             f"context-parallel-size ({self.cp})")
        if self.edp % self.dist_opt_instances:
            raise ValueError(f"num-distributed-optimizer-instances ({self.dist_opt_instances}) must divide the "
                             f"expert data-parallel size ({self.edp}) and so data-parallel x context-parallel size "
                             f"({self.dp} x {self.cp})")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: tp x cp x dp, regrouped as etp x ep x edp for the experts."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: replicas of each expert within one pipeline stage."""
        return self.stage_size // (self.etp * self.ep)

    @property
    def instance_dp_cp(self) -> int:
        """dp x cp ranks of one distributed-optimizer instance: the dense optimizer's sharding degree."""
        return self.dp * self.cp // self.dist_opt_instances

    @property
    def instance_edp(self) -> int:
        """Expert dp ranks of one distributed-optimizer instance: the expert optimizer's sharding degree."""
        return self.edp // self.dist_opt_instances

    @classmethod
    def from_world(cls, world_size: int, tp=1, cp=1, pp=1, ep=1, etp=None) -> Layout:
        model_parallel = tp * cp * pp
        if world_size % model_parallel:
            raise ValueError(f"world size ({world_size}) must be divisible by tp x cp x pp "
                             f"({tp} x {cp} x {pp} = {model_parallel})")
        return cls(tp=tp, cp=cp, dp=world_size // model_parallel, pp=pp, ep=ep, etp=etp)


@dataclass(frozen=True)
class Coordinates:
    """Where one rank sits: its index along every dimension of the dense and the expert layout."""

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


def rank_coordinates(rank: int, layout: Layout) -> Coordinates:
    """Pure function: global rank -> coordinates, rank order tp-cp-dp-pp (and etp-ep-edp-pp for experts)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside a world of {layout.world_size}")
    tp = rank % layout.tp
    cp = rank // layout.tp % layout.cp
    dp = rank // (layout.tp * layout.cp) % layout.dp
    pp = rank // (layout.tp * layout.cp * layout.dp)
    in_stage = rank % layout.stage_size  # tp + TP (cp + CP dp)
    return Coordinates(tp=tp, cp=cp, dp=dp, pp=pp, etp=in_stage % layout.etp, ep=in_stage // layout.etp % layout.ep,
                       edp=in_stage // (layout.etp * layout.ep))


def coordinates_rank(coords: dict, layout: Layout) -> int:
    """Inverse of `rank_coordinates` for the dense dimensions tp, cp, dp, pp."""
    return coords["tp"] + layout.tp * (coords["cp"] + layout.cp * (coords["dp"] + layout.dp * coords["pp"]))


@dataclass(frozen=True)
class TensorSplit:
    """Where a rank sits among the ranks that split a weight: dense weights are split over the tensor-parallel
    ranks, routed experts' over the expert-tensor-parallel ones (ShardSpec.expert)."""

    tp_rank: int = 0
    tp_size: int = 1
    etp_rank: int | None = None  # None: as tp
    etp_size: int | None = None

    def of(self, spec) -> tuple[int, int]:
        """(rank, size) of the split of a parameter with ShardSpec `spec`."""
        if spec.expert and self.etp_size is not None:
            return self.etp_rank, self.etp_size
        return self.tp_rank, self.tp_size


_DENSE_DIMS = ("tp", "cp", "dp", "pp")


def group_ranks(layout: Layout, kind: str) -> list[list[int]]:
    """All rank lists of one kind of group; every rank is in exactly one list of each kind."""
    members: dict[tuple, list[int]] = {}
    for rank in range(layout.world_size):
        c = rank_coordinates(rank, layout)
        key = _group_key(c, kind, layout)
        members.setdefault(key, []).append(rank)
    return list(members.values())


def _group_key(c: Coordinates, kind: str, layout: Layout) -> tuple:
    """Ranks in the same group share every coordinate except the ones the group spans."""
    if kind in ("cp_a2a", "cp_p2p"):  # cp index = a2a group x A + place in it
        a2a = layout.hierarchical_cp[0]
        return c.tp, c.dp, c.pp, c.cp // a2a if kind == "cp_a2a" else c.cp % a2a
    if kind in ("intra_dp_cp", "inter_dist_opt"):  # dp_cp index = instance x s + place in it
        dp_cp, size = c.cp + layout.cp * c.dp, layout.instance_dp_cp
        return c.tp, c.pp, dp_cp // size if kind == "intra_dp_cp" else dp_cp % size
    if kind == "intra_expert_dp":
        return c.etp, c.pp, c.ep, c.edp // layout.instance_edp
    spans = {
        "tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("dp", "cp"),
        "model_parallel": ("tp", "pp"), "etp": ("etp",), "ep": ("ep",), "expert_dp": ("edp",),
    }[kind]
    if kind in ("etp", "ep", "expert_dp"):
        fixed = {"etp": c.etp, "pp": c.pp, "ep": c.ep, "edp": c.edp}
        return tuple(v for k, v in fixed.items() if k not in spans)
    return tuple(getattr(c, d) for d in _DENSE_DIMS if d not in spans)


def embedding_group_ranks(layout: Layout) -> list[list[int]]:
    """First and last pipeline stage of each pipeline: they hold the tied input/output embedding."""
    return [sorted({ranks[0], ranks[-1]}) for ranks in group_ranks(layout, "pp")]


_GROUP_KINDS = ("tp", "cp", "dp", "dp_cp", "pp", "model_parallel", "ep", "expert_dp")  # and etp
_HIERARCHICAL_CP_KINDS = ("cp_a2a", "cp_p2p")
_INSTANCE_KINDS = {"intra_dp_cp": "dp_cp", "intra_expert_dp": "expert_dp", "inter_dist_opt": None}


class ParallelState:
    """The process groups of one layout, and this rank's place in it."""

    def __init__(self, layout: Layout, rank: int, groups: dict[str, dist.ProcessGroup | None],
                 pp_ranks: list[int], timeout: datetime.timedelta | None = None):
        self.layout = layout
        self.timeout = timeout  # of every group here; groups created later for this layout should use it
        self.rank = rank
        self.coords = rank_coordinates(rank, layout)
        self._groups = groups
        self.pp_ranks = pp_ranks  # global ranks of this rank's pipeline, stage order

    @classmethod
    def build(cls, layout: Layout, timeout: datetime.timedelta | None = None) -> ParallelState:
        """Create every group of `layout` on the default process group (a collective on all ranks); a
        collective that waits longer than `timeout` (torch's default when None) fails."""
        world = dist.get_world_size()
        if layout.world_size != world:
            raise ValueError(f"layout {layout} needs {layout.world_size} ranks but the world has {world}")
        rank = dist.get_rank()
        groups: dict[str, dist.ProcessGroup | None] = {}
        for kind in _GROUP_KINDS:
            groups[kind] = _new_groups_containing(rank, group_ranks(layout, kind), timeout)
        groups["etp"] = (groups["tp"] if layout.etp == layout.tp
                         else _new_groups_containing(rank, group_ranks(layout, "etp"), timeout))
        for kind in _HIERARCHICAL_CP_KINDS:
            groups[kind] = (_new_groups_containing(rank, group_ranks(layout, kind), timeout)
                            if layout.hierarchical_cp else None)
        for kind, whole in _INSTANCE_KINDS.items():  # one instance: the whole groups, nothing between them
            groups[kind] = (_new_groups_containing(rank, group_ranks(layout, kind), timeout)
                            if layout.dist_opt_instances > 1 else groups[whole] if whole else None)
        groups["embedding"] = _new_groups_containing(rank, embedding_group_ranks(layout), timeout)
        groups["world"] = dist.group.WORLD if world > 1 else None
        pp_ranks = next(r for r in group_ranks(layout, "pp") if rank in r)
        return cls(layout, rank, groups, pp_ranks, timeout)

    @classmethod
    def single(cls) -> ParallelState:
        """A layout of one rank with no process groups: the single-device reference."""
        return cls.without_groups(Layout(), 0)

    @classmethod
    def without_groups(cls, layout: Layout, rank: int) -> ParallelState:
        """Rank `rank`'s place in `layout`, with no process groups: enough to build and name its shard of a
        model (tools and tests), not to run it."""
        pp_ranks = next(r for r in group_ranks(layout, "pp") if rank in r)
        kinds = (*_GROUP_KINDS, "etp", *_HIERARCHICAL_CP_KINDS, *_INSTANCE_KINDS, "embedding", "world")
        return cls(layout, rank, dict.fromkeys(kinds), pp_ranks)

    def group(self, kind: str) -> dist.ProcessGroup | None:
        """The group of `kind` holding this rank (None when the layout has no such parallelism)."""
        return self._groups[kind]

    def group_names(self) -> dict[int, str]:
        """id(group) -> the kinds it serves ('dp/dp_cp' when one group is both), for reports naming a group."""
        names: dict[int, list[str]] = {}
        for kind, group in self._groups.items():
            if group is not None:
                names.setdefault(id(group), []).append(kind)
        return {key: "/".join(kinds) for key, kinds in names.items()}

    # Sizes and ranks, named as Megatron users know them.
    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def cp_rank(self) -> int:
        return self.coords.cp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def etp_size(self) -> int:
        return self.layout.etp

    @property
    def etp_rank(self) -> int:
        return self.coords.etp

    @property
    def tensor_split(self) -> TensorSplit:
        """This rank's place among the ranks splitting dense weights (tp) and routed experts' (etp)."""
        return TensorSplit(self.tp_rank, self.tp_size, self.etp_rank, self.etp_size)

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    @property
    def ep_rank(self) -> int:
        return self.coords.ep

    @property
    def edp_size(self) -> int:
        return self.layout.edp

    @property
    def dist_opt_instances(self) -> int:
        return self.layout.dist_opt_instances

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    def __repr__(self) -> str:
        return f"ParallelState(rank={self.rank}, {self.layout}, {self.coords})"


def _new_groups_containing(rank: int, all_ranks: list[list[int]],
                           timeout: datetime.timedelta | None) -> dist.ProcessGroup | None:
    """Create every group of one kind (all ranks must call new_group for each); keep this rank's own.

    Groups of one rank are never created: the collectives of a size-1 group are identities and the
    mappings skip them when the group is None.
    """
    mine = None
    for ranks in all_ranks:
        if len(ranks) == 1:
            continue
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine
