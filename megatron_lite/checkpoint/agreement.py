"""Agreeing on a problem before a collective: every rank raises the same error, none waits for the others.

A checkpoint problem is often visible to some ranks only: the coordinator alone reads the tracker and
holds the save lock, each rank verifies its own share of the files, a rank of one pipeline stage misses
tensors another finds. A rank that raised alone would leave the others waiting in the next collective
until the process group's timeout. So each check ends in one small collective over the checkpoint group
that tells every rank the first problem found anywhere, and every rank raises it (`CheckpointError`: one
line on every rank, see megatron_lite/errors.py). `group=None` is a run of one process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from megatron_lite.errors import CheckpointError


def rank_and_size(group) -> tuple[int, int]:
    return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)


def all_gather(item, group) -> list:
    """`item` of every rank of `group`, in rank order."""
    if group is None:
        return [item]
    items = [None] * dist.get_world_size(group)
    dist.all_gather_object(items, item, group=group)
    return items


def agree(problem: str | None, group, error: type[Exception] = CheckpointError) -> None:
    """Raise the first problem any rank found (`None`: this rank found none) as `error`, on every rank."""
    problem = next((p for p in all_gather(problem, group) if p is not None), None)
    if problem is not None:
        raise error(problem)


def decided_by_coordinator(decide: Callable, group, is_coordinator: bool):
    """`decide()`, run on the coordinator (rank 0) alone, returned on every rank; a CheckpointError it
    raises is raised on every rank."""
    outcome = [(None, None)]
    if is_coordinator:
        try:
            outcome = [(decide(), None)]
        except CheckpointError as error:
            outcome = [(None, str(error))]
    if group is not None:
        dist.broadcast_object_list(outcome, src=0, group=group)
    result, problem = outcome[0]
    if problem is not None:
        raise CheckpointError(problem)
    return result
