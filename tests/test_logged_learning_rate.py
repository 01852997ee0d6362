"""The logged learning rate is Megatron's: the scheduler's rate after the step, the one the next iteration uses.

Megatron's train_step steps the optimizer, then its OptimizerParamScheduler by the global batch
(`opt_param_scheduler.step(increment=...)`, num_steps counted in samples), and the loop logs
`param_group['lr']`: at iteration n the rate for num_steps = n x global-batch-size, while step n itself ran at
the rate for (n - 1) x global-batch-size.
"""

from __future__ import annotations

import math

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.training.loop import pretrain

GBS = 4
RUN = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
       "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 64, "seq_length": 16,
       "max_position_embeddings": 16, "micro_batch_size": 2, "global_batch_size": GBS, "train_iters": 6,
       "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": 2, "lr_decay_iters": 5, "lr_decay_style": "cosine",
       "eval_interval": 1000, "log_interval": 1000}


def megatron_lr(num_steps: int) -> float:
    """OptimizerParamScheduler.get_lr (megatron/core/optimizer_param_scheduler.py), cosine decay, for RUN:
    warmup and decay steps are the iteration flags times the global batch, init_lr is --lr-warmup-init (0)."""
    max_lr, min_lr, init_lr = RUN["lr"], RUN["min_lr"], 0.0
    warmup_steps, decay_steps = RUN["lr_warmup_iters"] * GBS, RUN["lr_decay_iters"] * GBS
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return init_lr + (max_lr - init_lr) * num_steps / warmup_steps
    if num_steps > decay_steps:
        return min_lr
    decay_ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps)
    return min_lr + 0.5 * (math.cos(math.pi * decay_ratio) + 1.0) * (max_lr - min_lr)


def test_logged_lr_is_the_schedulers_rate_after_each_step(monkeypatch):
    applied = []
    apply = Optimizer.apply

    def recording_apply(self, lr, *args, **kwargs):
        applied.append(lr)
        return apply(self, lr, *args, **kwargs)

    monkeypatch.setattr(Optimizer, "apply", recording_apply)
    history = pretrain(make_config(RUN), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    iterations = range(1, RUN["train_iters"] + 1)
    assert history[0]["lr"] == pytest.approx(RUN["lr"] / 2)  # iteration 1 of a 2-iteration warmup, not 0
    assert [h["lr"] for h in history] == pytest.approx([megatron_lr(n * GBS) for n in iterations], rel=1e-12)
    assert applied == pytest.approx([megatron_lr((n - 1) * GBS) for n in iterations], rel=1e-12)
