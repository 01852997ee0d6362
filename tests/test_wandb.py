"""W&B logging works offline: the run file read back holds the config and every logged loss."""

import glob
import json
import os

import pytest

import pretrain_gpt
from megatron_lite.config import make_config
from megatron_lite.training import pretrain
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
