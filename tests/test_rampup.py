"""Batch-size ramp-up (--rampup-batch-size START INCREMENT SAMPLES): the global batch of each step is the one
Megatron's formula gives for the samples consumed before it, the micro-batches follow, DP=2 trains as one
process, and a run resumed mid-ramp-up repeats the uninterrupted run bitwise."""

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, build_parser, make_config, parse_config
from megatron_lite.training import loop as training
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks

# The batch grows 2 -> 4 -> 6 -> 8 in 3 equal intervals of 24 / 3 = 8 samples, then stays 8 until 64 samples.
RAMP = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "seq_length": 16,
        "max_position_embeddings": 16, "micro_batch_size": 1, "global_batch_size": 8, "rampup_batch_size": [2, 2, 24],
        "train_samples": 64, "lr": 3e-3, "lr_warmup_samples": 8, "eval_interval": 1000, "log_interval": 1000}


def expected_batch(consumed: int) -> int:
    """START + INCREMENT x (whole intervals of SAMPLES / increments consumed), then the global batch."""
    return 2 + 2 * (consumed // 8) if consumed < 24 else 8


def expected_run() -> tuple[list[int], list[int]]:
    """Each step's global batch and the consumed samples after it, for the 64 samples of RAMP."""
    batches, consumed = [], [0]
    while consumed[-1] + expected_batch(consumed[-1]) <= 64:
        batches.append(expected_batch(consumed[-1]))
        consumed.append(consumed[-1] + batches[-1])
    return batches, consumed[1:]


def train(values: dict, world_size: int = 1) -> list[dict]:
    return pretrain(make_config(values, world_size), pretrain_gpt.model_provider, pretrain_gpt.forward_step)


def test_each_step_takes_the_ramped_global_batch_in_whole_micro_batches(monkeypatch):
    micro_batches = []  # forward steps run by each training step's schedule
    get_schedule = training.get_schedule

    def counting_schedule(config):
        schedule = get_schedule(config)

        def run(forward_step_func, data_iterator, model, num_microbatches, **kwargs):
            calls = []

            def counted(iterator, chunks):
                calls.append(1)
                return forward_step_func(iterator, chunks)

            result = schedule(counted, data_iterator, model, num_microbatches, **kwargs)
            micro_batches.append(len(calls))
            return result
        return run

    monkeypatch.setattr(training, "get_schedule", counting_schedule)
    history = train({**RAMP, "micro_batch_size": 2})
    batches, consumed = expected_run()
    assert batches == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    assert [h["global_batch_size"] for h in history] == batches
    assert [h["consumed_samples"] for h in history] == consumed
    assert micro_batches == [batch // 2 for batch in batches]


def _train_on_ranks(values: dict) -> list[dict]:
    return train(values, 2)


def test_rampup_at_dp2_trains_as_one_process():
    reference = train(RAMP)
    for rank_history in run_on_ranks(2, _train_on_ranks, RAMP):
        assert [h["global_batch_size"] for h in rank_history] == [h["global_batch_size"] for h in reference]
        assert [h["consumed_samples"] for h in rank_history] == [h["consumed_samples"] for h in reference]
        assert [h["lr"] for h in rank_history] == [h["lr"] for h in reference]
        assert [h["lm_loss"] for h in rank_history] == pytest.approx([h["lm_loss"] for h in reference], rel=1e-5)


def test_resume_mid_rampup_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    straight = train({**RAMP, "save": str(tmp_path / "straight")})
    # 5 steps consume 2+2+2+2+4 = 12 samples: the run stops inside the second interval of the ramp-up
    first = train({**RAMP, "save": str(tmp_path / "resumed"), "exit_interval": 5})
    assert first[-1]["consumed_samples"] == 12
    second = train({**RAMP, "save": str(tmp_path / "resumed"), "load": str(tmp_path / "resumed")})
    resumed = first + second
    for key in ("lm_loss", "grad_norm", "lr", "global_batch_size", "consumed_samples"):
        assert [h[key] for h in resumed] == [h[key] for h in straight], key


def test_rampup_flag_takes_three_values_and_says_what_they_mean():
    action = next(a for a in build_parser()._actions if "--rampup-batch-size" in a.option_strings)
    assert action.nargs == 3 and action.metavar == ("START", "INCREMENT", "SAMPLES")
    assert "grows by INCREMENT" in action.help and "micro-batches per step follow" in action.help
    config = parse_config(["--model-preset", "llama-tiny", "--mock-data", "--global-batch-size", "8",
                           "--rampup-batch-size", "2", "2", "24", "--train-samples", "64"])
    assert config.training.rampup_batch_size == [2, 2, 24] and config.training.train_iters == 12


@pytest.mark.parametrize("flags, world_size, message", [
    ({"rampup_batch_size": [3, 1, 24]}, 2, "rampup-batch-size START (3) must be divisible by micro-batch-size (1) x "
                                           "data-parallel size (2) = 2"),
    ({"rampup_batch_size": [2, 3, 24]}, 2, "rampup-batch-size INCREMENT (3) must be divisible by micro-batch-size "
                                           "(1) x data-parallel size (2) = 2"),
    ({"rampup_batch_size": [2, 4, 24]}, 1, "--rampup-batch-size must reach global-batch-size (8) from START (2) in "
                                           "steps of INCREMENT (4)"),
    ({"rampup_batch_size": [2, 2]}, 1, "--rampup-batch-size takes 3 values, START INCREMENT SAMPLES; got 2"),
    ({"rampup_batch_size": [0, 2, 24]}, 1, "START (0) and INCREMENT (2) must be positive"),
    ({"rampup_batch_size": [2, 2, 24], "train_samples": None, "train_iters": 10}, 1,
     "--rampup-batch-size acts only with --train-samples"),
    ({"rampup_batch_size": [2, 3, 24], "pipeline_model_parallel_size": 2, "num_layers": 4,
      "num_layers_per_virtual_pipeline_stage": 1}, 2,
     "rampup-batch-size INCREMENT (3) must be a multiple of pipeline-model-parallel-size (2) micro-batches (2 "
     "samples) for the interleaved schedule"),
])
def test_a_rampup_that_does_not_divide_is_a_one_line_error(flags, world_size, message):
    with pytest.raises(ConfigError) as error:
        make_config({**RAMP, **flags}, world_size)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_throughput_counts_the_tokens_of_each_ramped_batch():
    for record in train(RAMP):
        tokens = record["tokens_per_sec"] * record["iteration_time_s"]
        assert tokens == pytest.approx(record["global_batch_size"] * RAMP["seq_length"], rel=1e-9)
