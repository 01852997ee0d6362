"""Learning rate: linear warmup to --lr, then constant, linear or cosine decay to --min-lr."""

from __future__ import annotations

import math

from megatron_lite.config import OptimizerConfig


def learning_rate(config: OptimizerConfig, iteration: int) -> float:
    """The learning rate for optimizer step `iteration` (0-based), as Megatron's OptimizerParamScheduler."""
    if config.lr_warmup_iters and iteration < config.lr_warmup_iters:
        return config.lr * (iteration + 1) / config.lr_warmup_iters
    if config.lr_decay_style == "constant":
        return config.lr
    decay_steps = max(config.lr_decay_iters - config.lr_warmup_iters, 1)
    progress = min(max(iteration - config.lr_warmup_iters, 0) / decay_steps, 1.0)
    if config.lr_decay_style == "linear":
        coefficient = 1.0 - progress
    else:
        coefficient = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return config.min_lr + coefficient * (config.lr - config.min_lr)
