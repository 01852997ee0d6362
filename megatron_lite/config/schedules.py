"""The schedules a run follows, from its flags: their lengths in samples (optim/lr_schedule.py's values follow
them), and checks of the training length, the learning-rate warmup and decay, the weight-decay increment and
the batch-size ramp-up. Megatron's rules; each problem is one line saying what to change (validation.py
gathers them). `schedule_warnings` names the schedules a run will stop before completing, which start-up
prints without refusing the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


@dataclass(frozen=True)
class ScheduleLengths:
    """The schedules' lengths in samples (warmup may be fractional: --lr-warmup-fraction of the decay)."""

    warmup: float
    decay: int
    wsd_decay: int | None  # WSD's final annealing phase
    weight_decay_incr: int  # the whole run


def schedule_lengths(config: Config) -> ScheduleLengths:
    """The lengths the flags give, in samples (iteration flags times --global-batch-size)."""
    o, t = config.optimizer, config.training
    if t.train_samples is None:
        gbs = t.global_batch_size
        wsd_decay = None if o.lr_wsd_decay_iters is None else o.lr_wsd_decay_iters * gbs
        lengths = ScheduleLengths(o.lr_warmup_iters * gbs, o.lr_decay_iters * gbs, wsd_decay, t.train_iters * gbs)
    else:
        lengths = ScheduleLengths(o.lr_warmup_samples, o.lr_decay_samples, o.lr_wsd_decay_samples, t.train_samples)
    if o.lr_warmup_fraction is not None:
        lengths = ScheduleLengths(o.lr_warmup_fraction * lengths.decay, lengths.decay, lengths.wsd_decay,
                                  lengths.weight_decay_incr)
    return lengths


def schedule_problems(config: Config) -> list[str]:
    """Megatron's rules for the training length, batch ramp-up and schedules. That a run counts iterations
    (--train-iters) or samples (--train-samples), every schedule flag in the same unit, is flag_dependencies.py's."""
    o, t = config.optimizer, config.training
    problems = []
    if o.lr_warmup_init > o.lr:
        problems.append(f"lr-warmup-init ({o.lr_warmup_init}) must not exceed lr ({o.lr})")
    problems += _wsd_problems(config) + _weight_decay_problems(config)
    rampup = _rampup_problems(config)
    if not rampup and t.train_samples is not None and t.train_samples < config.global_batch_size_at(0):
        rampup = [f"train-samples ({t.train_samples}) must hold at least the first global batch "
                  f"({config.global_batch_size_at(0)})"]
    if problems or rampup:
        return problems + rampup
    return _reach_problems(config)


def _reach_problems(config: Config) -> list[str]:
    """Schedule flags that contradict each other: a value they state that no step could ever reach.

    Megatron's scheduler refuses a warmup that does not end before the decay does (the run would never reach
    --lr, or never decay); likewise --min-lr with a schedule that never decays."""
    o = config.optimizer
    unit, per = _schedule_unit(config)
    lengths = schedule_lengths(config)
    problems = []
    if lengths.warmup > 0 and lengths.warmup >= lengths.decay:
        problems.append(f"{_warmup_flag(config)} ({lengths.warmup / per:g}) must be below lr-decay-{unit} "
                        f"({lengths.decay / per:g}): the warmup must end before the decay does")
    if o.lr_decay_style == "constant" and o.min_lr > 0:
        problems.append(f"--min-lr ({o.min_lr}) is never reached with --lr-decay-style constant: drop it or "
                        f"choose a decaying style")
    return problems


def schedule_warnings(config: Config) -> list[str]:
    """Schedules this run stops before completing: fine for a run trained in pieces (resumed later with a
    larger --train-iters or --train-samples), so a warning, not a refusal. The last step begins once all but
    the final global batch are consumed."""
    o, t = config.optimizer, config.training
    unit, per = _schedule_unit(config)
    total = t.train_iters * t.global_batch_size if t.train_samples is None else t.train_samples
    last_step_start = total - t.global_batch_size
    lengths = schedule_lengths(config)
    train = f"train-{unit} ({total / per:g})"
    warnings = []
    if lengths.warmup > last_step_start:
        warnings.append(f"{_warmup_flag(config)} ({lengths.warmup / per:g}) reaches beyond {train}: this run ends "
                        f"before the learning rate reaches --lr ({o.lr})")
    elif o.lr_decay_style != "constant" and lengths.decay > total:
        warnings.append(f"lr-decay-{unit} ({lengths.decay / per:g}) reaches beyond {train}: this run ends before "
                        f"the learning rate decays to --min-lr ({o.min_lr})")
    if t.rampup_batch_size is not None and t.rampup_batch_size[2] > last_step_start:
        warnings.append(f"the ramp-up ({t.rampup_batch_size[2]} samples) reaches beyond the {total} samples of "
                        f"this run: the global batch never reaches global-batch-size ({t.global_batch_size})")
    return warnings


def _schedule_unit(config: Config) -> tuple[str, int]:
    """The unit the schedule flags count in, and its size in samples."""
    t = config.training
    return ("iters", t.global_batch_size) if t.train_samples is None else ("samples", 1)


def _warmup_flag(config: Config) -> str:
    unit = _schedule_unit(config)[0]
    return f"lr-warmup-fraction x lr-decay-{unit}" if config.optimizer.lr_warmup_fraction is not None \
        else f"lr-warmup-{unit}"


def _wsd_problems(config: Config) -> list[str]:
    o = config.optimizer
    unit = "iters" if config.training.train_samples is None else "samples"
    decay_phase, decay = getattr(o, f"lr_wsd_decay_{unit}"), getattr(o, f"lr_decay_{unit}")
    if o.lr_decay_style != "WSD":
        return []
    if decay_phase is None:
        return [f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (the length of its final decay phase)"]
    if decay_phase > decay:
        return [f"lr-wsd-decay-{unit} ({decay_phase}) must not exceed lr-decay-{unit} ({decay})"]
    return []


def _weight_decay_problems(config: Config) -> list[str]:
    o = config.optimizer
    start, end = o.start_weight_decay, o.end_weight_decay
    if o.weight_decay_incr_style == "constant":
        return []
    if start is None or end is None:
        return [f"--weight-decay-incr-style {o.weight_decay_incr_style} needs --start-weight-decay and "
                f"--end-weight-decay"]
    if end < start:
        return [f"end-weight-decay ({end}) must not be below start-weight-decay ({start}): the weight decay "
                f"increases over the run"]
    return []


def _rampup_problems(config: Config) -> list[str]:
    """Every global batch of the ramp-up must be whole micro-batches on every data-parallel rank (and, for
    the interleaved schedule, a multiple of the pipeline size), and the ramp must end at --global-batch-size."""
    t, p = config.training, config.parallel
    if t.rampup_batch_size is None:
        return []
    if len(t.rampup_batch_size) != 3:
        return [f"--rampup-batch-size takes 3 values, START INCREMENT SAMPLES; got {len(t.rampup_batch_size)}"]
    start, increment, samples = t.rampup_batch_size
    if start < 1 or increment < 1 or samples < 0:
        return [f"--rampup-batch-size START ({start}) and INCREMENT ({increment}) must be positive and SAMPLES "
                f"({samples}) not negative"]
    gbs = t.global_batch_size
    if start > gbs or (gbs - start) % increment:
        return [f"--rampup-batch-size must reach global-batch-size ({gbs}) from START ({start}) in steps of "
                f"INCREMENT ({increment})"]
    per_step = t.micro_batch_size * p.data_parallel_size
    sizes = {"START": start, "INCREMENT": increment} if start < gbs else {"START": start}
    problems = [f"rampup-batch-size {name} ({size}) must be divisible by micro-batch-size ({t.micro_batch_size}) "
                f"x data-parallel size ({p.data_parallel_size}) = {per_step}"
                for name, size in sizes.items() if size % per_step]
    pp = p.pipeline_model_parallel_size
    if not problems and config.virtual_pipeline_stages is not None:
        problems += [f"rampup-batch-size {name} ({size}) must be a multiple of pipeline-model-parallel-size ({pp}) "
                     f"micro-batches ({pp * per_step} samples) for the interleaved schedule"
                     for name, size in sizes.items() if size // per_step % pp]
    return problems
