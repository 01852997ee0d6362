"""The pipeline schedules step by step: live micro-batches stay within the 1F1B warm-up bound, one step's
gradients and a forward-only evaluation equal one process, and the opt-in trace pairs every send with its
receive (micro-batch and model chunk included)."""

import pytest

from tests.harness import run_on_ranks
from tests.helpers import TINY_8_LAYERS, assert_sends_pair_with_receives, assert_tensors_match, join_shards, one_step

M = 8
ONE_STEP = {**TINY_8_LAYERS, "micro_batch_size": 1, "global_batch_size": M}
LAYOUTS = {  # name: (flags, world size)
    "pp4_1f1b": ({"pipeline_model_parallel_size": 4}, 4),
    "pp4_vp2": ({"pipeline_model_parallel_size": 4, "num_layers_per_virtual_pipeline_stage": 1}, 4),
    "pp2_vp2": ({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2}, 2),
}


@pytest.fixture(scope="module")
def runs():
    results = {"reference": [one_step(ONE_STEP, 1)]}
    for name, (flags, world_size) in LAYOUTS.items():
        results[name] = run_on_ranks(world_size, one_step, {**ONE_STEP, **flags}, world_size, True)
    return results


def test_1f1b_stage_holds_at_most_its_warmup_plus_one_microbatches(runs):
    """Stage p of P runs P - p - 1 warm-up forwards, so at most P - p micro-batches are live (GPipe: all m)."""
    peaks = [r["peak_live"] for r in sorted(runs["pp4_1f1b"], key=lambda r: r["stage"])]
    assert peaks == [min(4 - p, M) for p in range(4)] == [4, 3, 2, 1]
    assert max(peaks) < M


@pytest.mark.parametrize(("name", "pp", "v"), [("pp4_vp2", 4, 2), ("pp2_vp2", 2, 2)])
def test_interleaved_stage_holds_at_most_its_warmup_plus_one_microbatches(runs, name, pp, v):
    """Interleaved warm-up is 2 (P - p - 1) + (v - 1) P forwards out of m v (all of them when m = P)."""
    for r in runs[name]:
        bound = min(2 * (pp - r["stage"] - 1) + (v - 1) * pp + 1, M * v)
        assert r["peak_live"] == bound
        assert r["forwards"] == M * v


@pytest.mark.parametrize("name", LAYOUTS)
def test_one_step_gradients_and_evaluation_equal_one_process(runs, name):
    reference = runs["reference"][0]
    for r in runs[name]:
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert r["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
    assert reference["eval_loss"] == pytest.approx(reference["loss"], rel=1e-6)  # same batch, same weights
    assert_tensors_match(join_shards([r["grads"] for r in runs[name]]), join_shards([reference["grads"]]))


@pytest.mark.parametrize(("name", "pp", "v"), [("pp4_1f1b", 4, 1), ("pp4_vp2", 4, 2), ("pp2_vp2", 2, 2)])
def test_trace_pairs_every_send_with_the_receive_of_the_same_microbatch(runs, name, pp, v):
    assert_sends_pair_with_receives(runs[name], pp, v, M)
