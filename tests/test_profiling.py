"""--profile writes one torch profiler trace (Chrome JSON) per chosen rank, of the chosen steps; the per-phase
timers reach W&B."""

import json
import os

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, build_parser, make_config
from megatron_lite.training import logging as training_logging
from megatron_lite.training.loop import pretrain
from megatron_lite.training.profiling import profile_dir
from tests.harness import run_on_ranks

TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "seq_length": 16,
        "max_position_embeddings": 16, "micro_batch_size": 1, "global_batch_size": 2, "train_iters": 4,
        "eval_interval": 1000, "log_interval": 1000}


def _train(values: dict) -> int:
    return len(pretrain(make_config(values, 2), pretrain_gpt.model_provider, pretrain_gpt.forward_step))


def test_two_rank_run_profiles_one_step_of_the_chosen_rank_only(tmp_path):
    values = {**TINY, "profile": True, "profile_step_start": 2, "profile_step_end": 3, "profile_ranks": [1],
              "profile_dir": str(tmp_path)}
    assert run_on_ranks(2, _train, values) == [4, 4]
    assert os.listdir(tmp_path) == ["rank1.pt.trace.json"]
    with open(tmp_path / "rank1.pt.trace.json") as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 1  # the one step in [2, 3)
    assert any(e.get("name", "").startswith("aten::") for e in events)  # what the step ran


def test_profile_directory_defaults_to_the_tensorboard_directory_then_profile():
    config = make_config({**TINY, "profile": True})
    assert profile_dir(config) == "profile"
    config.logging.tensorboard_dir = "runs/x"
    assert profile_dir(config) == "runs/x"
    config.logging.profile_dir = "traces"
    assert profile_dir(config) == "traces"


def test_profile_flags_are_in_help_with_their_meaning():
    actions = {action.option_strings[0]: action for action in build_parser()._actions if action.option_strings}
    assert "torch profiler trace" in actions["--profile"].help
    assert "first profiled step" in actions["--profile-step-start"].help
    assert "stops before" in actions["--profile-step-end"].help
    assert actions["--profile-ranks"].nargs == "+" and "default: 0" in actions["--profile-ranks"].help
    assert "--tensorboard-dir" in actions["--profile-dir"].help


@pytest.mark.parametrize("flags, message", [
    ({"profile_step_start": 3, "profile_step_end": 3}, "profile-step-end (3) must be after profile-step-start (3)"),
    ({"profile_ranks": [0, 2]}, "profile-ranks [2] are not ranks of this run (world size 2)"),
])
def test_bad_profile_flags_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError) as error:
        make_config({**TINY, "profile": True, **flags}, 2)
    assert message in str(error.value) and "\n" not in str(error.value)


class _FakeWandbRun:
    id = "fake"

    def __init__(self):
        self.logged, self.summary = [], {}

    def log(self, values: dict, step: int):
        self.logged.append(values)

    def finish(self):
        pass


def test_phase_timers_reach_wandb(monkeypatch):
    run = _FakeWandbRun()
    monkeypatch.setattr(training_logging, "start_wandb", lambda config: run)
    config = make_config({**TINY, "train_iters": 2, "log_interval": 1, "wandb_project": "test"})
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    assert len(run.logged) == 2
    for phase in ("forward_backward", "grad_reduce", "optimizer", "data_wait"):
        assert all(record[f"time_{phase}_ms"] >= 0 for record in run.logged)
    assert all(record["iteration_time_s"] > 0 for record in run.logged)
