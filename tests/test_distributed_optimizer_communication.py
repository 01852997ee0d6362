"""--use-distributed-optimizer communicates as Megatron's does: one reduce-scatter of each bucket per step
(not per micro-batch), started inside the last micro-batch's backward with --overlap-grad-reduce, and the
parameter all-gathers after the step issued in forward order."""

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron_lite.parallel import mappings
from megatron_lite.training.loop import build_data_iterator, build_datasets, train_step
from tests.harness import run_on_ranks
from tests.helpers import build_run

MICROBATCHES = 4


def one_step_of_collectives(overlap_grad_reduce: bool, overlap_param_gather: bool) -> dict:
    config, pstate, device, model, optimizer = build_run(
        {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "seq_length": 32,
         "max_position_embeddings": 32, "micro_batch_size": 1, "global_batch_size": MICROBATCHES * 2,
         "train_iters": 2, "use_distributed_optimizer": True, "ddp_bucket_size": 50_000,
         "overlap_grad_reduce": overlap_grad_reduce, "overlap_param_gather": overlap_param_gather}, world_size=2)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    chunk = model[0]
    calls = []
    originals = {"reduce_scatter": mappings.reduce_scatter_tensor, "all_gather": mappings.all_gather_into_tensor}

    def recorded(kind):
        def call(output, tensor, group, async_op=False):
            in_backward = torch._C._current_graph_task_id() != -1
            owner = next((i for i, b in enumerate(chunk.buckets) if tensor is b.grad_data or output is b.param_data),
                         None)
            calls.append((kind, owner, in_backward))
            return originals[kind](output, tensor, group, async_op=async_op)
        return call

    mappings.reduce_scatter_tensor = recorded("reduce_scatter")
    mappings.all_gather_into_tensor = recorded("all_gather")
    try:
        train_step(pretrain_gpt.forward_step, iterator, model, optimizer, config, pstate, 0, device)
    finally:
        mappings.reduce_scatter_tensor = originals["reduce_scatter"]
        mappings.all_gather_into_tensor = originals["all_gather"]
    dist.barrier()
    return {"strategy": config.parallel.data_parallel_sharding_strategy, "buckets": len(chunk.buckets),
            "calls": calls}


@pytest.mark.parametrize(("overlap_grad_reduce", "overlap_param_gather"), [(False, False), (True, True)])
def test_one_reduce_scatter_per_bucket_per_step_and_gathers_in_forward_order(overlap_grad_reduce,
                                                                              overlap_param_gather):
    for result in run_on_ranks(2, one_step_of_collectives, overlap_grad_reduce, overlap_param_gather):
        assert result["strategy"] == "optim"
        buckets = result["buckets"]
        assert buckets >= 2  # the order below means something
        scatters = [(owner, in_backward) for kind, owner, in_backward in result["calls"] if kind == "reduce_scatter"]
        gathers = [owner for kind, owner, _ in result["calls"] if kind == "all_gather"]
        assert sorted(owner for owner, _ in scatters) == list(range(buckets))  # once each, not per micro-batch
        assert all(in_backward == overlap_grad_reduce for _, in_backward in scatters)
        assert gathers == list(reversed(range(buckets)))  # buckets are in backward order: forward is reversed
