"""A training step reads values from the device once: the loss and the gradient norm, together.

Every `.item()`, `.tolist()`, `float(t)`, `int(t)` or `bool(t)` of a CUDA tensor stalls the host until the
GPU catches up. On the CPU they cost nothing, so they are counted here instead of timed.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pretrain_gpt
from megatron_lite.training.host_reads import counted_device_reads
from megatron_lite.training.loop import build_data_iterator, build_datasets, train_step
from tests.helpers import build_run


@pytest.mark.parametrize("extra", [{}, {"bf16": True}, {"fp16": True, "initial_loss_scale": 256.0},
                                   {"use_distributed_optimizer": True}])
def test_a_training_step_of_four_micro_batches_reads_the_device_once(extra):
    config, pstate, device, model, optimizer = build_run(
        {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "seq_length": 32,
         "max_position_embeddings": 32, "micro_batch_size": 1, "global_batch_size": 4, "train_iters": 3, **extra}, 1)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    train_step(pretrain_gpt.forward_step, iterator, model, optimizer, config, pstate, 0, device)
    batches = [next(iterator) for _ in range(config.num_microbatches)]  # read outside the counted step
    counts: list[str] = []
    step_counters = [state["step"] for adam in optimizer.adams for state in adam.state.values()]
    assert all(counter.device.type == "cpu" for counter in step_counters)
    with counted_device_reads(counts, step_counters):
        metrics = train_step(pretrain_gpt.forward_step, iter(batches), model, optimizer, config, pstate, 1, device)
    assert counts == ["tolist"], counts
    assert metrics["skipped_iter"] == 0 and metrics["grad_norm"] > 0


class _HostValuesToDevice(TorchDispatchMode):
    """Records each tensor made from host values (torch.tensor([...]) and the like: aten.lift_fresh), which on
    CUDA is a blocking host-to-device copy."""

    def __init__(self):
        super().__init__()
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.made += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("extra", [{}, {"bf16": True, "use_distributed_optimizer": True}])
def test_a_training_step_makes_no_tensor_from_host_values(extra):
    config, pstate, device, model, optimizer = build_run(
        {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "seq_length": 32, "clip_grad": 1.0,
         "max_position_embeddings": 32, "micro_batch_size": 1, "global_batch_size": 2, "train_iters": 3, **extra}, 1)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    train_step(pretrain_gpt.forward_step, iterator, model, optimizer, config, pstate, 0, device)
    batches = [next(iterator) for _ in range(config.num_microbatches)]
    with _HostValuesToDevice() as recorder:
        train_step(pretrain_gpt.forward_step, iter(batches), model, optimizer, config, pstate, 1, device)
    assert recorder.made == 0
