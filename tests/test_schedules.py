"""Learning-rate and weight-decay schedules follow Megatron's formulas, written out here; --train-samples trains as
the equivalent --train-iters; bad schedule flags are one-line errors."""

import math

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, build_parser, make_config
from megatron_lite.config.schedules import schedule_warnings
from megatron_lite.optim.lr_schedule import learning_rate, weight_decay
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.training.loop import pretrain

BASE = {"model_preset": "llama-tiny", "mock_data": True, "micro_batch_size": 1, "global_batch_size": 4,
        "lr": 1.0, "min_lr": 0.1}
GBS = BASE["global_batch_size"]


def schedule(**flags):
    return make_config({**BASE, **flags})


def lrs(config, iterations: int) -> list[float]:
    """The learning rate of each step of a run without ramp-up (step i begins after i global batches)."""
    return [learning_rate(config, i * GBS) for i in range(iterations)]


def test_warmup_then_cosine_decay():
    config = schedule(train_iters=12, lr_warmup_iters=4, lr_warmup_init=0.2, lr_decay_iters=10)
    expected = [0.2 + 0.8 * i / 4 for i in range(5)]  # warmup from --lr-warmup-init, --lr at its end
    expected += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - 4) / 6)) for i in range(5, 11)]
    expected += [0.1]  # past --lr-decay-iters: --min-lr
    assert lrs(config, 12) == pytest.approx(expected, rel=1e-12)


def test_linear_and_constant_decay():
    linear = schedule(train_iters=10, lr_warmup_iters=2, lr_decay_style="linear")
    assert lrs(linear, 10) == pytest.approx([0.0, 0.5] + [0.1 + 0.9 * (1 - (i - 2) / 8) for i in range(2, 10)])
    constant = schedule(train_iters=6, lr_warmup_iters=2, lr_decay_style="constant", min_lr=0.0)
    assert lrs(constant, 6) == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("style, f", [("linear", lambda t: 1 - t),
                                      ("cosine", lambda t: 0.5 * (1 + math.cos(math.pi * t))),
                                      ("exponential", lambda t: 2 * 0.5**t - 1),
                                      ("minus_sqrt", lambda t: 1 - math.sqrt(t))])
def test_wsd_warms_up_holds_then_decays_in_its_last_iterations(style, f):
    config = schedule(train_iters=14, lr_warmup_iters=2, lr_decay_style="WSD", lr_wsd_decay_style=style,
                      lr_decay_iters=12, lr_wsd_decay_iters=4)
    got = lrs(config, 14)
    assert got[:3] == [0.0, 0.5, 1.0]  # warmup
    assert got[3:9] == [1.0] * 6  # stable: exactly --lr up to the decay phase, which begins after 12 - 4
    assert got[9:13] == pytest.approx([0.1 + 0.9 * f(k / 4) for k in range(1, 5)], rel=1e-12)  # decay
    assert got[12] == pytest.approx(0.1) and got[13] == 0.1  # --min-lr at its end and after


def test_warmup_fraction_is_of_the_decay():
    config = schedule(train_iters=10, lr_warmup_fraction=0.25, lr_decay_iters=8, lr_decay_style="linear")
    assert lrs(config, 3) == pytest.approx([0.0, 0.5, 1.0])  # 0.25 x 8 iterations = 2


def test_weight_decay_increments_over_the_run():
    linear = schedule(train_iters=8, weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1)
    cosine = schedule(train_iters=8, weight_decay_incr_style="cosine", start_weight_decay=0.02, end_weight_decay=0.1)
    assert [weight_decay(linear, i * GBS) for i in range(9)] == pytest.approx([0.1 * i / 8 for i in range(9)])
    assert [weight_decay(cosine, i * GBS) for i in range(9)] == pytest.approx(
        [0.02 + 0.08 * 0.5 * (1 + math.cos(math.pi * (1 - i / 8))) for i in range(9)])
    assert weight_decay(schedule(train_iters=8, weight_decay=0.3), 5 * GBS) == 0.3


def test_each_step_applies_its_weight_decay_to_matrices_only(monkeypatch):
    """AdamW's weight decay in each step is the schedule's for weight matrices and 0 for norms and biases."""
    applied = []
    apply = Optimizer.apply

    def recording_apply(self, lr, grad_norm, weight_decay=None):
        updated = apply(self, lr, grad_norm, weight_decay)
        # matrices, then the rest
        applied.append([group["weight_decay"] for adam in self.adams for group in adam.param_groups])
        return updated

    monkeypatch.setattr(Optimizer, "apply", recording_apply)
    config = schedule(train_iters=4, num_layers=1, seq_length=16, max_position_embeddings=16, eval_interval=1000,
                      log_interval=1000, weight_decay_incr_style="linear", start_weight_decay=0.0,
                      end_weight_decay=0.08)
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    assert [wd for step in applied for wd in step] == pytest.approx([0.0, 0.0, 0.02, 0.0, 0.04, 0.0, 0.06, 0.0])


def test_train_samples_trains_as_the_equivalent_train_iters():
    tiny = {**BASE, "num_layers": 1, "seq_length": 16, "max_position_embeddings": 16, "lr": 3e-3, "min_lr": 0.0,
            "eval_interval": 3, "eval_iters": 1, "log_interval": 1000}
    by_iterations = make_config({**tiny, "train_iters": 6, "lr_warmup_iters": 2, "lr_decay_iters": 5})
    # 26 samples hold 6 whole global batches of 4; the last 2 are dropped
    by_samples = make_config({**tiny, "train_samples": 26, "lr_warmup_samples": 8, "lr_decay_samples": 20})
    assert by_samples.training.train_iters == 6
    runs = [pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
            for config in (by_iterations, by_samples)]
    for key in ("lm_loss", "lr", "consumed_samples"):
        assert [h[key] for h in runs[0]] == [h[key] for h in runs[1]]


def help_of(flag: str):
    """The --help entry of `flag`: its argparse action (help text, choices, number of values)."""
    return next(action for action in build_parser()._actions if flag in action.option_strings)


def test_schedule_flags_are_in_help_with_their_meaning():
    for flag, meaning in (("--lr-decay-style", "WSD (warmup-stable-decay)"), ("--lr-wsd-decay-style", "decay phase"),
                          ("--lr-wsd-decay-iters", "decay phase"), ("--lr-wsd-decay-samples", "decay phase"),
                          ("--lr-warmup-fraction", "fraction"), ("--lr-warmup-init", "starts from"),
                          ("--train-samples", "instead of --train-iters"), ("--lr-decay-samples", "samples"),
                          ("--lr-warmup-samples", "samples"), ("--weight-decay-incr-style", "--start-weight-decay"),
                          ("--start-weight-decay", "first step"), ("--end-weight-decay", "last step")):
        assert meaning in help_of(flag).help, flag
    assert help_of("--lr-decay-style").choices == ["constant", "linear", "cosine", "WSD"]
    assert help_of("--lr-wsd-decay-style").choices == ["linear", "cosine", "exponential", "minus_sqrt"]
    assert help_of("--weight-decay-incr-style").choices == ["constant", "linear", "cosine"]


@pytest.mark.parametrize("flags, message", [
    ({"lr_decay_style": "WSD"}, "--lr-decay-style WSD needs --lr-wsd-decay-iters (the length of its final decay "
                                "phase)"),
    ({"train_samples": 40, "lr_decay_style": "WSD"}, "--lr-decay-style WSD needs --lr-wsd-decay-samples"),
    ({"lr_decay_style": "WSD", "lr_wsd_decay_iters": 200}, "lr-wsd-decay-iters (200) must not exceed "
                                                           "lr-decay-iters (100)"),
    ({"lr_wsd_decay_iters": 5}, "--lr-wsd-decay-iters acts only with --lr-decay-style WSD"),
    ({"train_iters": 10, "train_samples": 40}, "--train-iters and --train-samples exclude each other"),
    ({"lr_decay_samples": 40}, "--lr-decay-samples acts only with --train-samples"),
    ({"train_samples": 40, "lr_warmup_iters": 2}, "--lr-warmup-iters and --train-samples exclude each other"),
    ({"train_samples": 3}, "train-samples (3) must hold at least the first global batch (4)"),
    ({"lr_warmup_fraction": 0.1, "lr_warmup_iters": 2},
     "--lr-warmup-fraction and --lr-warmup-iters exclude each other"),
    ({"lr_warmup_init": 2.0}, "lr-warmup-init (2.0) must not exceed lr (1.0)"),
    ({"lr_warmup_fraction": 1.5}, "lr-warmup-fraction (1.5) must be at least 0 and below 1"),
    ({"weight_decay_incr_style": "linear"}, "--weight-decay-incr-style linear needs --start-weight-decay and "
                                            "--end-weight-decay"),
    ({"start_weight_decay": 0.0}, "--start-weight-decay acts only with --weight-decay-incr-style linear or cosine"),
    ({"weight_decay_incr_style": "cosine", "start_weight_decay": 0.1, "end_weight_decay": 0.0},
     "end-weight-decay (0.0) must not be below start-weight-decay (0.1)"),
    # Megatron's scheduler: the warmup ends before the decay does (by default the decay lasts the whole run)
    ({"train_iters": 4, "lr_warmup_iters": 10}, "lr-warmup-iters (10) must be below lr-decay-iters (4): the warmup "
                                                "must end before the decay does"),
    ({"train_iters": 1, "lr_warmup_iters": 1}, "lr-warmup-iters (1) must be below lr-decay-iters (1)"),
    ({"train_samples": 40, "lr_warmup_samples": 40}, "lr-warmup-samples (40) must be below lr-decay-samples (40)"),
    ({"train_samples": 400, "lr_warmup_samples": 30, "lr_decay_samples": 20},
     "lr-warmup-samples (30) must be below lr-decay-samples (20)"),
    ({"lr_decay_style": "constant"}, "--min-lr (0.1) is never reached with --lr-decay-style constant"),
])
def test_bad_schedule_flags_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError) as error:
        schedule(**flags)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("flags, warning", [
    ({"train_iters": 4, "lr_warmup_iters": 4, "lr_decay_iters": 100},
     "lr-warmup-iters (4) reaches beyond train-iters (4): this run ends before the learning rate reaches --lr (1.0)"),
    ({"train_samples": 40, "lr_warmup_samples": 39, "lr_decay_samples": 400},
     "lr-warmup-samples (39) reaches beyond train-samples (40)"),
    ({"train_iters": 4, "lr_decay_iters": 10},
     "lr-decay-iters (10) reaches beyond train-iters (4): this run ends before the learning rate decays to --min-lr"),
    ({"train_samples": 40, "rampup_batch_size": [1, 1, 40]},
     "the ramp-up (40 samples) reaches beyond the 40 samples of this run: the global batch never reaches"),
])
def test_schedules_a_run_stops_before_completing_are_warned_of(flags, warning):
    """A run trained in pieces legitimately ends mid-schedule (resumed later with a larger --train-iters), so
    these are warnings printed at start-up, not refusals."""
    assert warning in " ".join(schedule_warnings(schedule(**flags)))


def test_a_schedule_the_run_completes_has_no_warning():
    # the last step begins after 3 of 4 batches: a 3-iteration warmup reaches --lr in it
    assert schedule_warnings(schedule(train_iters=4, lr_warmup_iters=3)) == []
    assert schedule_warnings(schedule(train_samples=40, rampup_batch_size=[1, 1, 36])) == []
