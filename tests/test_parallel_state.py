"""Rank layout: the rank -> coordinates mapping (pure) and the process groups built from it."""

import itertools

import pytest
import torch.distributed as dist

from megatron_lite.parallel.state import (
    Layout,
    ParallelState,
    coordinates_rank,
    embedding_group_ranks,
    group_ranks,
    rank_coordinates,
)
from tests.harness import run_on_ranks

LAYOUTS = [Layout(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
           for tp, cp, dp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 3), (1, 2, 4))
           for ep in (1, 2, 4) if (dp * cp) % ep == 0]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_coordinates_are_a_bijection_in_tp_cp_dp_pp_order(layout):
    seen = set()
    for rank in range(layout.world_size):
        c = rank_coordinates(rank, layout)
        assert coordinates_rank({"tp": c.tp, "cp": c.cp, "dp": c.dp, "pp": c.pp}, layout) == rank
        seen.add((c.tp, c.cp, c.dp, c.pp))
    assert len(seen) == layout.world_size
    if layout.world_size > 1:
        assert rank_coordinates(1, layout).tp == (1 if layout.tp > 1 else 0)  # tp varies fastest


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_groups_partition_the_world_with_the_right_sizes(layout):
    sizes = {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp, "pp": layout.pp, "dp_cp": layout.dp * layout.cp,
             "model_parallel": layout.tp * layout.pp, "ep": layout.ep, "expert_dp": layout.edp}
    for kind, size in sizes.items():
        groups = group_ranks(layout, kind)
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), kind
        assert all(len(g) == size for g in groups), kind
    for group in group_ranks(layout, "ep"):  # an EP group lies inside one stage's dp x cp ranks
        assert len({rank_coordinates(r, layout).pp for r in group}) == 1
        assert len({rank_coordinates(r, layout).tp for r in group}) == 1
    for ep_group in group_ranks(layout, "ep"):  # expert replicas x expert shards = the stage's dp x cp
        for edp_group in group_ranks(layout, "expert_dp"):
            assert len(set(ep_group) & set(edp_group)) <= 1


def test_known_layout_matches_megatron_order():
    layout = Layout(tp=2, cp=1, dp=2, pp=2)
    assert group_ranks(layout, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(layout, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(layout, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert embedding_group_ranks(layout) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    expert = Layout(tp=1, cp=2, dp=2, pp=1, ep=2)
    assert group_ranks(expert, "ep") == [[0, 1], [2, 3]]
    assert group_ranks(expert, "expert_dp") == [[0, 2], [1, 3]]


def test_hierarchical_cp_groups_split_each_cp_group():
    """cp 4 as 2 x 2 with tp 2: a2a groups are 2 adjacent cp ranks, p2p groups the cp ranks 2 apart."""
    layout = Layout(tp=2, cp=4, dp=1, pp=2, hierarchical_cp=(2, 2))
    assert group_ranks(layout, "cp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert group_ranks(layout, "cp_a2a") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert group_ranks(layout, "cp_p2p") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert group_ranks(Layout(cp=8, hierarchical_cp=(4, 2)), "cp_p2p") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(Layout(cp=8, hierarchical_cp=(2, 4)), "cp_p2p") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match="must multiply to context-parallel-size"):
        Layout(cp=4, hierarchical_cp=(2, 3))


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="expert-model-parallel-size"):
        Layout(dp=3, ep=2)
    with pytest.raises(ValueError, match="divisible"):
        Layout.from_world(6, tp=4)


def check_groups_on_four_ranks():
    results = {}
    for tp, pp in ((2, 2), (1, 4), (4, 1)):
        state = ParallelState.build(Layout.from_world(4, tp=tp, pp=pp))
        member_lists = {}
        for kind in ("tp", "pp", "dp", "embedding"):
            group = state.group(kind)
            member_lists[kind] = None if group is None else sorted(dist.get_process_group_ranks(group))
        results[(tp, pp)] = (member_lists, state.is_first_stage, state.is_last_stage, state.next_rank,
                             state.prev_rank)
    return results


def test_groups_built_on_a_four_rank_world():
    per_rank = run_on_ranks(4, check_groups_on_four_ranks)
    members, first, last, nxt, prev = per_rank[1][(2, 2)]
    assert members == {"tp": [0, 1], "pp": [1, 3], "dp": None, "embedding": [1, 3]}
    assert (first, last, nxt, prev) == (True, False, 3, None)
    members, first, last, nxt, prev = per_rank[2][(1, 4)]
    assert members["pp"] == [0, 1, 2, 3] and members["embedding"] is None  # a middle stage
    assert (first, last, nxt, prev) == (False, False, 3, 1)
    assert per_rank[3][(1, 4)][0]["embedding"] == [0, 3]
    members, *_ = per_rank[3][(4, 1)]
    assert members == {"tp": [0, 1, 2, 3], "pp": None, "dp": None, "embedding": None}
