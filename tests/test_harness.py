"""The multi-rank harness returns per-rank results, re-raises a rank's failure and never hangs."""

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_on_ranks
from tests.helpers import train_and_collect


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


def gloo_threads() -> int:
    """Gloo runs three threads per live process group; the count says how many groups are still alive."""
    import gc

    gc.collect()
    from pathlib import Path

    names = [path.read_text().strip() for path in Path("/proc/self/task").glob("*/comm")]
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def train_briefly(values: dict, world_size: int) -> None:
    import pretrain_gpt
    from megatron_lite.config.arguments import make_config
    from megatron_lite.training.loop import pretrain

    pretrain(make_config(values, world_size), pretrain_gpt.model_provider, pretrain_gpt.forward_step)


TINY = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64, "seq_length": 16,
        "max_position_embeddings": 16, "vocab_size": 64, "make_vocab_size_divisible_by": 8, "mock_data": True,
        "attention_dropout": 0.0, "micro_batch_size": 1, "global_batch_size": 4, "train_iters": 2, "lr": 1e-3,
        "log_interval": 1000, "eval_interval": 1000}
LAYOUTS = {
    "tp2_pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "sequence_parallel": True},
    "cp2_zero1": {"context_parallel_size": 2, "use_distributed_optimizer": True, "overlap_grad_reduce": True},
    "zero3_overlap": {"data_parallel_sharding_strategy": "optim_grads_params", "overlap_param_gather": True},
    "moe_ep2": {"num_experts": 4, "moe_router_topk": 2, "expert_model_parallel_size": 2, "disable_bias_linear": True},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_finished_training_run_frees_its_process_groups(layout):
    """A dropped model and its process groups are freed: nothing (a gradient hook held by autograd in C++)
    keeps them alive, so a long-lived process does not accumulate gloo threads run after run."""
    [before, *_] = run_on_ranks(4, gloo_threads)
    run_on_ranks(4, train_briefly, {**TINY, **LAYOUTS[layout]}, 4)
    assert run_on_ranks(4, gloo_threads) == [before] * 4


def test_tasks_that_read_their_trained_model_leave_no_group_alive():
    """A test helper that keeps the model it trained, to read its weights afterwards, keeps it only as long as the
    task: after each such task the world's workers are back to the default group's gloo threads (a model held at
    module level kept its run's groups, and their threads, alive through the tasks that followed)."""
    layouts = [{"pipeline_model_parallel_size": 2}, {"tensor_model_parallel_size": 2}]
    [before, _] = run_on_ranks(2, gloo_threads)
    after = []
    for layout in layouts:
        run_on_ranks(2, train_and_collect, {**TINY, **layout}, 2)
        after.append(run_on_ranks(2, gloo_threads))
    assert after == [[before] * 2] * len(layouts)
