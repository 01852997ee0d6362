"""W&B logging works offline: the run file read back holds the config and every logged loss; a resumed run
continues the W&B run that saved its checkpoint."""

import glob
import json
import os

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.training.logging import wandb_run_id
from megatron_lite.training.loop import pretrain
from tests.wandb_records import read_run


def test_offline_wandb_run_holds_config_and_losses(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    values = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "seq_length": 32,
              "max_position_embeddings": 32, "global_batch_size": 4, "micro_batch_size": 4, "train_iters": 3,
              "log_interval": 1, "eval_interval": 1000, "wandb_project": "megatron-lite-test",
              "wandb_exp_name": "tiny", "wandb_save_dir": str(tmp_path)}
    history = pretrain(make_config(values), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    [path] = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
    run = read_run(path)
    assert (run["project"], run["name"]) == ("megatron-lite-test", "tiny")
    assert json.loads(run["config"]["model"])["hidden_size"] == 128
    logged = [json.loads(h["lm_loss"]) for h in run["history"] if "lm_loss" in h]
    assert logged == pytest.approx([h["lm_loss"] for h in history], rel=1e-12)
    assert all("tokens_per_sec" in h and "grad_norm" in h for h in run["history"] if "lm_loss" in h)


def _tiny_run(**values) -> dict:
    return make_config({"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "seq_length": 32,
                        "max_position_embeddings": 32, "global_batch_size": 4, "micro_batch_size": 4,
                        "log_interval": 1, "eval_interval": 1000, **values})


def test_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    """WANDB_PROJECT and WANDB_DIR stand in for the flags; the run resumed from the checkpoint logs to the W&B run
    that saved it, whose summary names the newest checkpoint."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "megatron-lite-test")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    save = str(tmp_path / "checkpoints")
    config = _tiny_run(train_iters=4, save=save, load=save, save_interval=2, exit_interval=2)
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    config = _tiny_run(train_iters=4, save=save, load=save, save_interval=2)
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    runs = [read_run(path) for path in glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))]
    runs.sort(key=lambda run: min(json.loads(h["_step"]) for h in run["history"]))
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"]
    assert [[json.loads(h["_step"]) for h in run["history"]] for run in runs] == [[1, 2], [3, 4]]
    assert runs[0]["project"] == "megatron-lite-test"
    assert json.loads(runs[1]["summary"]["checkpoint_iteration"]) == 4
    assert json.loads(runs[1]["summary"]["checkpoint_path"]) == os.path.join(save, "iter_0000004")


def test_wandb_run_id_comes_from_the_environment_first(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_RUN_ID", "from-env")
    (tmp_path / "wandb_run_id.txt").write_text("from-checkpoint\n")
    assert wandb_run_id(_tiny_run(train_iters=1, load=str(tmp_path))) == "from-env"
    monkeypatch.delenv("WANDB_RUN_ID")
    assert wandb_run_id(_tiny_run(train_iters=1, load=str(tmp_path))) == "from-checkpoint"
    assert wandb_run_id(_tiny_run(train_iters=1, load=str(tmp_path), finetune=True)) is None
