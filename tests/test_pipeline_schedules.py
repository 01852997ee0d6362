"""The pipeline schedules step by step: live micro-batches stay within the 1F1B warm-up bound, one step's
gradients and a forward-only evaluation equal one process, and the opt-in trace pairs every send with its
receive (micro-batch and model chunk included)."""

import collections
import contextlib
import io
import os
import re

import pytest
import torch

import pretrain_gpt
from megatron_lite import training
from megatron_lite.config import make_config
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.parallel.p2p import TRACE_ENV
from megatron_lite.pipeline.schedules import ScheduleStats
from tests.harness import run_on_ranks
from tests.helpers import TINY_8_LAYERS, assert_tensors_match, join_shards, parameter_records

M = 8
ONE_STEP = {**TINY_8_LAYERS, "micro_batch_size": 1, "global_batch_size": M}
LAYOUTS = {  # name: (flags, world size)
    "pp4_1f1b": ({"pipeline_model_parallel_size": 4}, 4),
    "pp4_vp2": ({"pipeline_model_parallel_size": 4, "num_layers_per_virtual_pipeline_stage": 1}, 4),
    "pp2_vp2": ({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2}, 2),
}


@contextlib.contextmanager
def _environment(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def one_step(values: dict, world_size: int, trace: bool = False) -> dict:
    """A forward-only pass over one global batch, then one training step's gradients, with schedule stats."""
    config = make_config(values, world_size)
    pstate, device = training.initialize(config)
    model = training.build_model(config, pstate, pretrain_gpt.model_provider, device)
    train_ds, _, _ = training.build_datasets(config)
    schedule = training.get_schedule(config)
    stats, stderr = ScheduleStats(), io.StringIO()
    with contextlib.redirect_stderr(stderr), _environment(TRACE_ENV, "1" if trace else "0"):
        with torch.no_grad():
            reports, _ = schedule(pretrain_gpt.forward_step, training.build_data_iterator(train_ds, config, pstate, 0),
                                  model, config.num_microbatches, pstate=pstate, config=config, forward_only=True)
        eval_loss = float(training.reduce_loss(reports, pstate, device))
        reports, tokens = schedule(pretrain_gpt.forward_step, training.build_data_iterator(train_ds, config, pstate, 0),
                                   model, config.num_microbatches, pstate=pstate, config=config, stats=stats)
    finalize_model_grads(model, pstate, tokens)
    return {"eval_loss": eval_loss, "loss": float(training.reduce_loss(reports, pstate, device)),
            "stage": pstate.pp_rank,
            "grads": parameter_records(model, lambda p: p.main_grad), "peak_live": stats.peak_live,
            "forwards": sum(kind == "F" for kind, *_ in stats.events), "trace": stderr.getvalue()}


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


_OP = re.compile(r"rank (\d+) (?:->|<-) rank (\d+) (send|recv) (activation|gradient) microbatch (\d+) chunk (\d+)")


@pytest.mark.parametrize(("name", "pp", "v"), [("pp4_1f1b", 4, 1), ("pp4_vp2", 4, 2), ("pp2_vp2", 2, 2)])
def test_trace_pairs_every_send_with_the_receive_of_the_same_microbatch(runs, name, pp, v):
    assert_sends_pair_with_receives(runs[name], pp, v, M)


def assert_sends_pair_with_receives(results: list[dict], pp: int, v: int, m: int):
    """Each send (rank, peer, micro-batch, chunk) of an evaluation and a training pass is received by that peer
    for the same micro-batch, by the chunk that follows in the ring (the last stage's chunk c feeds the first
    stage's chunk c + 1)."""
    sends, receives = collections.Counter(), collections.Counter()
    for r in results:
        for rank, peer, kind, what, mb, chunk in _OP.findall(r["trace"]):
            rank, peer, mb, chunk = int(rank), int(peer), int(mb), int(chunk)
            if kind == "recv":
                receives[(peer, rank, what, mb, chunk)] += 1
            elif what == "activation":  # with PP alone a global rank is its stage
                sends[(rank, peer, what, mb, chunk + (peer == 0))] += 1
            else:
                sends[(rank, peer, what, mb, chunk - (rank == 0))] += 1
        assert len(re.findall(r"stage \d+ busy .* peak live micro-batches", r["trace"])) == 2
    assert sends == receives
    per_pass = m * (pp * v - 1)  # hand-overs between consecutive virtual stages
    assert sum(n for key, n in sends.items() if key[2] == "activation") == 2 * per_pass  # evaluation + training
    assert sum(n for key, n in sends.items() if key[2] == "gradient") == per_pass
