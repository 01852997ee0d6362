"""Resuming from a checkpoint continues the run exactly; the load flags and the exit conditions behave."""

import importlib.util
import os
import signal

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors
from megatron_lite.checkpoint.planner import CheckpointError
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# GPT-2 style with dropout, so that resuming also has to restore the random generators.
TINY = {"model_preset": "gpt2-124m", "mock_data": True, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
        "ffn_hidden_size": 128, "vocab_size": 300, "seq_length": 32, "max_position_embeddings": 32,
        "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 10, "lr": 3e-3, "lr_warmup_iters": 2,
        "lr_decay_iters": 10, "eval_interval": 4, "eval_iters": 1, "log_interval": 1000}


def train(values: dict, world_size: int = 1, forward_step=pretrain_gpt.forward_step) -> list[float]:
    config = make_config(values, world_size)
    return [h["lm_loss"] for h in pretrain(config, pretrain_gpt.model_provider, forward_step)]


def _same_tensors(path_a: str, path_b: str) -> list[str]:
    """Keys whose tensors differ (bitwise) between two checkpoints; both must hold the same keys."""
    a, b = read_checkpoint_tensors(path_a), read_checkpoint_tensors(path_b)
    assert a.keys() == b.keys()
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in a) and any(k.startswith("rng_state.") for k in a)
    return [key for key in a if not torch.equal(a[key], b[key])]


def straight_and_resumed(values: dict, root: str, world_size: int = 1) -> tuple[list, list]:
    """10 iterations in one go vs 5, stop (--exit-interval), resume 5 more (async saves for the second half)."""
    straight = train({**values, "save": f"{root}/straight", "save_interval": 5}, world_size)
    first = train({**values, "save": f"{root}/resumed", "save_interval": 5, "exit_interval": 5}, world_size)
    second = train({**values, "save": f"{root}/resumed", "load": f"{root}/resumed", "save_interval": 5,
                    "async_save": True}, world_size)
    return straight, first + second


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    straight, resumed = straight_and_resumed(TINY, str(tmp_path))
    assert len(resumed) == 10 and resumed == straight  # fp32 losses, bitwise
    assert _same_tensors(f"{tmp_path}/straight/iter_0000010", f"{tmp_path}/resumed/iter_0000010") == []
    saved = directory.read_metadata(f"{tmp_path}/resumed/iter_0000010")
    assert saved["iteration"] == 10 and saved["consumed_samples"] == 40
    assert saved["optimizer"]["optimizer.step"] == 10


@pytest.mark.parametrize("precision", [{"bf16": True},
                                       {"fp16": True, "initial_loss_scale": 2.0**16, "loss_scale_window": 2}])
def test_low_precision_resume_keeps_fp32_masters_and_loss_scale(tmp_path, precision):
    """bf16/fp16 weights with fp32 masters (optimizer.state.fp32_param) and, for fp16, the dynamic loss
    scaler's state (metadata.json): resumed exactly."""
    values = {**TINY, **precision, "train_iters": 4, "lr_decay_iters": 4, "eval_interval": 1000}
    straight = train({**values, "save": f"{tmp_path}/straight"})
    first = train({**values, "save": f"{tmp_path}/resumed", "exit_interval": 2})
    second = train({**values, "save": f"{tmp_path}/resumed", "load": f"{tmp_path}/resumed"})
    assert first + second == straight
    assert _same_tensors(f"{tmp_path}/straight/iter_0000004", f"{tmp_path}/resumed/iter_0000004") == []
    masters = read_checkpoint_tensors(f"{tmp_path}/resumed/iter_0000004", "optimizer.state.fp32_param.")
    assert masters and all(t.dtype == torch.float32 for t in masters.values())
    scalers = [directory.read_metadata(f"{tmp_path}/{run}/iter_0000004")["optimizer"]["optimizer.grad_scaler"]
               for run in ("straight", "resumed")]
    assert scalers[0] == scalers[1]
    if "fp16" in precision:
        assert scalers[0]["scale"] != 2.0**16  # the scale moved: resuming had state to restore


def _resume_on_ranks(values: dict, root: str) -> tuple[list, list, list]:
    straight, resumed = straight_and_resumed(values, root, world_size=2)
    return straight, resumed, _same_tensors(f"{root}/straight/iter_0000010", f"{root}/resumed/iter_0000010")


def test_resume_is_bitwise_identical_at_tp2_with_sequence_parallel_dropout(tmp_path):
    """Two ranks, each with its own tensor-parallel random stream (dropout on sequence-parallel slices)."""
    values = {**TINY, "tensor_model_parallel_size": 2, "sequence_parallel": True}
    for straight, resumed, differing in run_on_ranks(2, _resume_on_ranks, values, str(tmp_path)):
        assert resumed == straight
        assert differing == []


def test_no_load_optim_and_finetune(tmp_path):
    root = str(tmp_path)
    straight = train({**TINY, "train_iters": 7})
    train({**TINY, "save": root, "train_iters": 5})
    # --no-load-optim: same weights, data position and generators, fresh Adam moments: iteration 6 has the
    # same loss, its update differs.
    fresh_optimizer = train({**TINY, "load": root, "no_load_optim": True, "train_iters": 7})
    assert fresh_optimizer[0] == straight[5] and fresh_optimizer[1] != straight[6]
    # --finetune: the weights only; iteration, data position and optimizer start from zero.
    finetuned = train({**TINY, "load": root, "finetune": True, "train_iters": 2})
    assert len(finetuned) == 2 and finetuned[0] < straight[0] - 0.01
    with pytest.raises(ConfigError, match="--finetune acts only with --load"):
        make_config({**TINY, "finetune": True})


def test_checkpoint_of_another_model_shape_fails_with_a_clear_error(tmp_path):
    train({**TINY, "save": str(tmp_path), "train_iters": 1})
    with pytest.raises(CheckpointError, match="has global shape .* but this model expects .*configuration differs"):
        train({**TINY, "load": str(tmp_path), "hidden_size": 128})


def test_keep_last_n_exit_duration_and_tracker(tmp_path):
    root = str(tmp_path)
    train({**TINY, "save": root, "save_interval": 1, "keep_last_n": 2, "train_iters": 4})
    assert directory.complete_iterations(root) == [3, 4] and directory.read_tracker(root) == 4
    # A time limit stops every rank after the iteration that crosses it, with a checkpoint.
    assert len(train({**TINY, "save": root, "load": root, "exit_duration_in_mins": 1e-9})) == 1
    assert directory.latest_iteration(root) == 5


def _sigterm_rank1_at_iteration_3(data_iterator, model):
    """The forward step, plus SIGTERM to rank 1 (as from a scheduler) during iteration 3."""
    _sigterm_rank1_at_iteration_3.calls += 1
    if torch.distributed.get_rank() == 1 and _sigterm_rank1_at_iteration_3.calls == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return pretrain_gpt.forward_step(data_iterator, model)


def _train_until_sigterm(values: dict) -> tuple[int, int | None]:
    _sigterm_rank1_at_iteration_3.calls = 0
    losses = train(values, 2, forward_step=_sigterm_rank1_at_iteration_3)
    return len(losses), directory.latest_iteration(values["save"])


def test_sigterm_on_one_rank_stops_every_rank_with_a_checkpoint(tmp_path):
    values = {**TINY, "micro_batch_size": 1, "global_batch_size": 2, "save": str(tmp_path),
              "exit_signal_handler": True}
    assert run_on_ranks(2, _train_until_sigterm, values) == [(3, 3), (3, 3)]


def test_inspect_checkpoint_reports_iteration_layout_and_global_shapes(tmp_path, capsys):
    train({**TINY, "save": str(tmp_path), "train_iters": 2})
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "inspect_checkpoint.py")
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main([str(tmp_path), "--check"])
    out = capsys.readouterr().out
    assert "iteration         2" in out and "consumed samples  8" in out
    assert "saved in layout   TP1 x CP1 x DP1 x PP1 x EP1" in out
    assert "embedding.word_embeddings.weight" in out and "(300, 64)" in out  # unpadded vocabulary
    assert "all finite" in out
