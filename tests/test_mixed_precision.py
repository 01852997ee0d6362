"""bf16 and fp16 training: low-precision weights, fp32 gradients and masters, fp16 loss scaling.

bf16 on the CPU trains and its losses track fp32's within 1e-3 (relative, every step of 10). fp16: a step
whose gradients overflow is skipped on every rank (weights and Adam's step count unchanged), the dynamic
scale follows Megatron's rule (hysteresis 2: the second overflow halves it), and no weight turns NaN.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.optim.loss_scaler import DynamicGradScaler
from megatron_lite.training.loop import build_data_iterator, build_datasets, train_step
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, build_run, train_with_state

FP16 = {**TINY_2_LAYERS, "fp16": True, "initial_loss_scale": 2.0**8}


def test_bf16_on_cpu_trains_and_tracks_fp32():
    fp32, bf16 = train_with_state(TINY_2_LAYERS, 1), train_with_state({**TINY_2_LAYERS, "bf16": True}, 1)
    assert {w.dtype for w in bf16["weights"].values()} == {torch.bfloat16}
    masters = [v for k, v in bf16["state"].items() if k.startswith("optimizer.state.fp32_param.")]
    assert masters and all(data.dtype == torch.float32 for data, _, _ in masters)
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=1e-3)
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.3


def _poisoned_forward_step(poison: dict, data_iterator, model):
    """pretrain_gpt.forward_step, whose loss is infinite while poison["on"] (an injected fp16 overflow)."""
    output, loss_func = pretrain_gpt.forward_step(data_iterator, model)

    def poisoned_loss(output_tensor):
        loss_sum, num_tokens, report = loss_func(output_tensor)
        return (loss_sum * float("inf") if poison["on"] else loss_sum), num_tokens, report

    return output, poisoned_loss


def train_with_overflows(values: dict, world_size: int, poisoned_steps: set, poisoned_rank: int) -> dict:
    """Train 6 steps, overflowing on `poisoned_rank` at `poisoned_steps`; per step: skipped, scale, weights."""
    config, pstate, device, model, optimizer = build_run(values, world_size)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    poison = {"on": False}
    steps = []
    for iteration in range(6):
        poison["on"] = iteration in poisoned_steps and pstate.rank == poisoned_rank
        metrics = train_step(partial(_poisoned_forward_step, poison), iterator, model, optimizer, config, pstate,
                             iteration, device)
        with model[0].gathered_parameters():
            weights = torch.cat([p.detach().float().reshape(-1) for p in model[0].module.parameters()])
        steps.append({"skipped": metrics["skipped_iter"], "scale": metrics["loss_scale"], "weights": weights,
                      "adam_steps": optimizer.sharded_state_dict()["optimizer.step"]})
    return {"steps": steps, "dtypes": {str(p.dtype) for p in model[0].module.parameters()}}


def check_overflow_handling(run: dict) -> None:
    steps = run["steps"]
    assert run["dtypes"] == {"torch.float16"}
    assert [s["skipped"] for s in steps] == [0, 0, 1, 1, 0, 0]
    # Megatron's hysteresis of 2: the first overflow keeps the scale, the second halves it.
    assert [s["scale"] for s in steps] == [2.0**8, 2.0**8, 2.0**8, 2.0**7, 2.0**7, 2.0**7]
    assert torch.equal(steps[1]["weights"], steps[2]["weights"])  # skipped steps change nothing
    assert torch.equal(steps[2]["weights"], steps[3]["weights"])
    assert not torch.equal(steps[3]["weights"], steps[4]["weights"])  # training resumes
    assert [s["adam_steps"] for s in steps] == [1, 2, 2, 2, 3, 4]
    assert all(torch.isfinite(s["weights"]).all() for s in steps)


def test_fp16_overflow_skips_the_step_lowers_the_scale_and_leaves_finite_weights():
    check_overflow_handling(train_with_overflows(FP16, 1, {2, 3}, 0))


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_with_zero2():
    values = {**FP16, "data_parallel_sharding_strategy": "optim_grads"}
    runs = run_on_ranks(2, train_with_overflows, values, 2, {2, 3}, 1)
    for run in runs:
        check_overflow_handling(run)
    for a, b in zip(runs[0]["steps"], runs[1]["steps"]):
        assert torch.equal(a["weights"], b["weights"])


def test_dynamic_scaler_grows_after_a_clean_window_and_stops_at_the_minimum():
    scaler = DynamicGradScaler(initial_scale=4.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    for found_inf, expected in ((False, 4.0), (False, 4.0), (False, 8.0), (True, 8.0), (True, 4.0), (True, 2.0),
                                (True, 1.0), (True, 1.0), (False, 1.0), (False, 1.0), (False, 2.0)):
        scaler.update(found_inf)
        assert scaler.scale == expected
    assert scaler.hysteresis_tracker == 2  # growth restores the hysteresis budget
    restored = DynamicGradScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


@pytest.mark.parametrize("values, message", [
    ({"loss_scale": 128.0}, "--loss-scale acts only with --fp16"),
    ({"fp16": True, "hysteresis": 0}, "hysteresis (0)"),
    ({"overlap_param_gather": True}, "--overlap-param-gather acts only with --use-distributed-optimizer"),
])
def test_bad_precision_and_sharding_flags_fail_with_what_to_change(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_config({**TINY_2_LAYERS, **values}, 2)
