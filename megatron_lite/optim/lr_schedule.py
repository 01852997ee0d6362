"""Learning rate and weight decay as Megatron's OptimizerParamScheduler has them: functions of consumed samples.

Megatron measures its schedules in samples, so that a growing batch (--rampup-batch-size) moves them by
what it reads. Iteration flags count global batches of --global-batch-size (--lr-decay-iters 10 is 10 x
global-batch-size samples); with --train-samples the -samples flags count samples. The step that begins
after c consumed samples uses the values at c, so a warmup's first step runs at --lr-warmup-init, and a
resumed run, which restores c, continues with exactly the values of one that never stopped.

With W warmup, D decay and A annealing (WSD) samples:

    c <= W (warmup)        lr_warmup_init + (lr - lr_warmup_init) * c / W
    constant               lr
    c > D                  min_lr
    linear, cosine         min_lr + (lr - min_lr) * f((c - W) / (D - W))
    WSD                    lr until D - A, then min_lr + (lr - min_lr) * f((c - (D - A)) / A),
                           f given by --lr-wsd-decay-style

where f(t) is 1 - t (linear), (1 + cos(pi t)) / 2 (cosine), 2 * 0.5^t - 1 (exponential) or 1 - sqrt(t)
(minus_sqrt). Weight decay moves from --start-weight-decay to --end-weight-decay over the whole run.
"""

from __future__ import annotations

import math

from megatron_lite.config.schedules import schedule_lengths
from megatron_lite.config.sections import Config

# The fraction of (lr - min_lr) left after a fraction t of the decay.
_DECAY_COEFFICIENTS = {
    "linear": lambda t: 1.0 - t,
    "cosine": lambda t: 0.5 * (math.cos(math.pi * t) + 1.0),
    "exponential": lambda t: 2.0 * 0.5**t - 1.0,
    "minus_sqrt": lambda t: 1.0 - math.sqrt(t),
}


def learning_rate(config: Config, consumed_samples: int) -> float:
    """The learning rate of the step that begins after `consumed_samples` samples."""
    o, lengths = config.optimizer, schedule_lengths(config)
    c, warmup, decay = consumed_samples, lengths.warmup, lengths.decay
    if warmup > 0 and c <= warmup:
        return o.lr_warmup_init + (o.lr - o.lr_warmup_init) * c / warmup
    if o.lr_decay_style == "constant":
        return o.lr
    if c > decay:
        return o.min_lr
    if o.lr_decay_style == "WSD":
        annealed = c - (decay - lengths.wsd_decay)
        if annealed <= 0:
            return o.lr  # the stable phase
        coefficient = _DECAY_COEFFICIENTS[o.lr_wsd_decay_style](annealed / lengths.wsd_decay)
    else:
        coefficient = _DECAY_COEFFICIENTS[o.lr_decay_style]((c - warmup) / (decay - warmup))
    return o.min_lr + coefficient * (o.lr - o.min_lr)


def weight_decay(config: Config, consumed_samples: int) -> float:
    """The weight decay of the step that begins after `consumed_samples` samples (--weight-decay-incr-style)."""
    o = config.optimizer
    if o.weight_decay_incr_style == "constant":
        return o.weight_decay
    t = min(consumed_samples / schedule_lengths(config).weight_decay_incr, 1.0)
    coefficient = t if o.weight_decay_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - t)) + 1.0)
    return o.start_weight_decay + coefficient * (o.end_weight_decay - o.start_weight_decay)
