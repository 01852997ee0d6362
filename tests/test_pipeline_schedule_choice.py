"""--pipeline-schedule gpipe and zb-h1 compute what one process computes: one step's loss, evaluation and
gradients equal the single-device ones over PP2 and PP4, with fewer micro-batches than stages and with more;
trained with TP2 and sequence parallelism, in bf16 (and ZB-H1 with the distributed optimizer and overlapped
gradient reduction over DP2), losses and weights equal the single-device run's. GPipe holds every
micro-batch of the step, ZB-H1 at most P until their weight-gradient pass; every send is received; bad
combinations are one-line errors."""

import pytest

from megatron_lite.config.arguments import ConfigError, make_config
from tests.harness import run_on_ranks
from tests.helpers import (
    TINY_8_LAYERS,
    assert_run_matches,
    assert_sends_pair_with_receives,
    assert_tensors_match,
    join_shards,
    one_step,
    reference,
    train_and_collect,
)

SCHEDULES = ("gpipe", "zb-h1")
CASES = [(pp, m) for pp in (2, 4) for m in (3, 8)]  # m below and above the number of stages
_RUNS: dict = {}


def step_values(m: int) -> dict:
    return {**TINY_8_LAYERS, "micro_batch_size": 1, "global_batch_size": m}


def runs_of(schedule: str, pp: int, m: int) -> list[dict]:
    """One step of `schedule` over `pp` stages and `m` micro-batches, per rank (computed once)."""
    key = (schedule, pp, m)
    if key not in _RUNS:
        values = {**step_values(m), "pipeline_model_parallel_size": pp, "pipeline_schedule": schedule}
        _RUNS[key] = sorted(run_on_ranks(pp, one_step, values, pp, True), key=lambda r: r["stage"])
    return _RUNS[key]


def single_device(m: int) -> dict:
    key = ("single", 1, m)
    if key not in _RUNS:
        _RUNS[key] = one_step(step_values(m), 1)
    return _RUNS[key]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("pp", "m"), CASES)
def test_one_step_gradients_and_evaluation_equal_one_process(schedule, pp, m):
    ref = single_device(m)
    results = runs_of(schedule, pp, m)
    for r in results:
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
        assert r["forwards"] == m
    assert_tensors_match(join_shards([r["grads"] for r in results]), join_shards([ref["grads"]]))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("pp", "m"), CASES)
def test_trace_pairs_every_send_with_its_receive(schedule, pp, m):
    assert_sends_pair_with_receives(runs_of(schedule, pp, m), pp, 1, m)


@pytest.mark.parametrize(("pp", "m"), CASES)
def test_gpipe_stage_holds_every_microbatch(pp, m):
    assert [r["peak_live"] for r in runs_of("gpipe", pp, m)] == [m] * pp


@pytest.mark.parametrize(("pp", "m"), CASES)
def test_zb_h1_stage_holds_at_most_p_microbatches_until_their_weight_pass(pp, m):
    """B frees nothing: a micro-batch is held from its forward to its W. Stage p's B runs as 1F1B's backward
    (at most P - p live), and its W passes wait for at most P micro-batches on every stage."""
    results = runs_of("zb-h1", pp, m)
    assert [r["peak_live"] for r in results] == [min(pp - stage, m) for stage in range(pp)]
    assert [r["peak_held"] for r in results] == [min(pp, m)] * pp


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_with_tp2_and_sequence_parallel_trains_as_one_process(schedule):
    """Tensor parallelism brings its own rounding (1e-4 on weights, as in test_pipeline_parallel)."""
    values = {**TINY_8_LAYERS, "tensor_model_parallel_size": 2, "sequence_parallel": True,
              "pipeline_model_parallel_size": 2, "pipeline_schedule": schedule}
    assert_run_matches(run_on_ranks(4, train_and_collect, values, 4), reference(TINY_8_LAYERS), tensor_rel=1e-4)


def test_zb_h1_with_distributed_optimizer_and_overlapped_reduce_over_dp2_trains_as_one_process():
    """Losses of 4 steps and the final weights; a rank's gradient buffer is reduced only in the shard it owns,
    so the weights, moved by every step's gradients, carry the gradient comparison."""
    values = {**TINY_8_LAYERS, "pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1",
              "use_distributed_optimizer": True, "overlap_grad_reduce": True}
    results = run_on_ranks(4, train_and_collect, values, 4)
    ref_losses, ref_weights, _ = reference(TINY_8_LAYERS)
    for losses, _, _ in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_tensors_match(join_shards([r[1] for r in results]), join_shards([ref_weights]), floor=1e-5)


@pytest.mark.parametrize(("values", "world_size", "message"), [
    ({"pipeline_schedule": "gpipe"}, 1, "--pipeline-schedule acts only with --pipeline-model-parallel-size above 1; "
                                        "add that or drop --pipeline-schedule"),
    ({"pipeline_schedule": "gpipe", "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2},
     2, "--pipeline-schedule gpipe has no interleaved form; drop --num-layers-per-virtual-pipeline-stage / "
        "--num-virtual-stages-per-pipeline-rank or use 1f1b"),
    ({"pipeline_schedule": "zb-h1", "pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2},
     2, "--pipeline-schedule zb-h1 has no interleaved form; drop --num-layers-per-virtual-pipeline-stage / "
        "--num-virtual-stages-per-pipeline-rank or use 1f1b"),
    ({"pipeline_schedule": "zb-h1", "pipeline_model_parallel_size": 2,
      "data_parallel_sharding_strategy": "optim_grads"}, 4,
     "--pipeline-schedule zb-h1 cannot be combined with --data-parallel-sharding-strategy optim_grads: ZeRO-2/3 "
     "reduce gradients after every autograd call and zb-h1 runs one per weight group; use "
     "--use-distributed-optimizer (ZeRO-1) or 1f1b"),
    ({"pipeline_schedule": "zb-h1", "pipeline_model_parallel_size": 2, "recompute_granularity": "full"}, 2,
     "--pipeline-schedule zb-h1 cannot be combined with --recompute-granularity full: every weight group's pass "
     "would recompute its layer's forward; use selective or 1f1b"),
])
def test_bad_schedule_combinations_are_one_line_errors(values, world_size, message):
    with pytest.raises(ConfigError) as error:
        make_config({**TINY_8_LAYERS, **values}, world_size)
    assert str(error.value) == message


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bf16_over_pp2_trains_as_bf16_on_one_process(schedule):
    """bf16 weights and activations, fp32 gradients and masters: the stages pass bf16 tensors, and the
    weight-gradient passes of ZB-H1 accumulate into the same fp32 gradients as a whole backward."""
    values = {**TINY_8_LAYERS, "bf16": True}
    parallel = {**values, "pipeline_model_parallel_size": 2, "pipeline_schedule": schedule}
    assert_run_matches(run_on_ranks(2, train_and_collect, parallel, 2), reference(values))
