"""Each logged iteration says where its time went: forward-backward, gradient reduction, optimizer, data."""

import time

import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import pretrain
from megatron_lite.training.timers import PhaseTimers


def test_phase_timers_sum_each_phase_until_read_and_count_blocked_reads_as_data_wait():
    timers = PhaseTimers(torch.device("cpu"))
    for _ in range(2):
        with timers.phase("optimizer"):
            time.sleep(0.02)

    def slow_source():
        time.sleep(0.03)
        yield "batch"

    assert list(timers.timed_iterator(slow_source())) == ["batch"]
    first = timers.read()
    assert 40 <= first["time_optimizer_ms"] < 2000
    assert 30 <= first["time_data_wait_ms"] < 2000
    assert first["time_forward_backward_ms"] == first["time_grad_reduce_ms"] == 0
    assert set(timers.read().values()) == {0.0}


def test_every_iteration_record_splits_its_time_into_phases(capsys):
    config = make_config({"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "seq_length": 32,
                          "max_position_embeddings": 32, "micro_batch_size": 2, "global_batch_size": 4,
                          "train_iters": 3})
    history = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    for record in history:
        phases = [record[f"time_{name}_ms"] for name in ("forward_backward", "grad_reduce", "optimizer")]
        assert all(value >= 0 for value in phases) and phases[0] > 0 and phases[2] > 0
        assert sum(phases) <= 1e3 * record["iteration_time_s"] * 1.01
        assert record["time_data_wait_ms"] <= phases[0]  # micro-batches are read inside the schedule
    assert capsys.readouterr().out.count("ms fwd-bwd/reduce/optim/data") == 3

