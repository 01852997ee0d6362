"""The multi-rank harness returns per-rank results, re-raises a rank's failure and never hangs."""

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_on_ranks


def rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), float(t)


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one is unhappy")
    dist.barrier()


def hang_on_rank_zero():
    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins


def test_results_come_back_in_rank_order():
    assert run_on_ranks(2, rank_and_sum) == [(0, 3.0), (1, 3.0)]


def test_a_rank_failure_is_reraised_with_its_traceback():
    with pytest.raises(AssertionError, match="(?s)rank 1 failed.*rank one is unhappy"):
        run_on_ranks(2, fail_on_rank_one, timeout=60)


def test_a_hang_fails_after_the_timeout():
    with pytest.raises(TimeoutError):
        run_on_ranks(2, hang_on_rank_zero, timeout=5)
    assert run_on_ranks(2, rank_and_sum)[0] == (0, 3.0)  # a fresh world replaces the killed one
