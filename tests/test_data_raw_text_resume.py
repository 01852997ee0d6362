"""Training from raw text resumes at another layout: a DP2 run stopped after iteration 5 and resumed at DP4 and at
TP2 x DP2 trains as the uninterrupted DP2 run from iteration 6 on, on the same samples (token for token) and
with the same losses to float rounding, from the loader position its checkpoint holds."""

import contextlib
import functools
import io
import json
import os

import numpy as np
import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks
from tests.test_data_raw_text import random_documents, write_documents
from tests.test_data_raw_text_training import raw_values

ITERS, STOP, GBS = 10, 5, 8


def _recording_forward_step(seen: list, data_iterator, model):
    """pretrain_gpt's forward step, keeping the micro-batch's samples (tokens and the last label) on the ranks
    that first read each data-parallel share (TP rank 0 of the first stage)."""
    batch = next(data_iterator)
    p = model.pstate
    if p.tp_rank == 0 and p.is_first_stage:
        seen.append(np.concatenate([batch["tokens"].numpy(), batch["labels"].numpy()[:, -1:]], axis=1))
    return pretrain_gpt.forward_step(iter([batch]), model)


def _train(values: dict, world_size: int) -> dict:
    """One run: its losses, this rank's samples by global sample index (the PretrainingSampler gives data-parallel
    rank r of d the rows r*b..r*b+b-1 of each step of d*b samples, b = --micro-batch-size), and rank 0's log."""
    config = make_config(values, world_size)
    seen, log = [], io.StringIO()
    ranks = {}

    def provider(config, pstate, plan, device):
        ranks.update(dp=pstate.dp_rank, dp_size=pstate.dp_size)
        return pretrain_gpt.model_provider(config, pstate, plan, device)

    with contextlib.redirect_stdout(log):
        history = pretrain(config, provider, functools.partial(_recording_forward_step, seen))
    b, d = config.training.micro_batch_size, ranks["dp_size"]
    start = history[0]["consumed_samples"] - GBS
    samples = {start + k * b * d + ranks["dp"] * b + j: row
               for k, batch in enumerate(seen) for j, row in enumerate(batch)}
    return {"losses": [h["lm_loss"] for h in history], "samples": samples, "log": log.getvalue()}


def _dp2_runs(values: dict, root: str) -> dict:
    return {"uninterrupted": _train(values, 2),
            "first half": _train({**values, "save": root, "exit_interval": STOP}, 2)}


def _resumes_on_four_ranks(values: dict, root: str) -> dict:
    return {"dp4": _train({**values, "load": root}, 4),
            "tp2xdp2": _train({**values, "load": root, "tensor_model_parallel_size": 2}, 4)}


def _merged(per_rank: list[dict], name: str) -> dict:
    """A run's losses (the same on every rank) and every rank's samples together."""
    samples = {}
    for rank in per_rank:
        samples.update(rank[name]["samples"])
    return {"losses": per_rank[-1][name]["losses"], "samples": samples, "log": per_rank[0][name]["log"]}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("raw_resume") / "a.jsonl"
    write_documents(path, random_documents(60, 0))  # 80 samples of 16 tokens read it once and part again
    return str(path)


def test_a_dp2_run_resumed_at_dp4_and_tp2xdp2_trains_as_the_uninterrupted_run(corpus, tmp_path):
    values = raw_values([corpus], train_iters=ITERS)
    root = str(tmp_path / "checkpoints")
    dp2 = run_on_ranks(2, _dp2_runs, values, root)
    uninterrupted, first = _merged(dp2, "uninterrupted"), _merged(dp2, "first half")
    assert sorted(uninterrupted["samples"]) == list(range(ITERS * GBS))
    assert first["losses"] == uninterrupted["losses"][:STOP]
    with open(os.path.join(root, f"iter_{STOP:07d}", "metadata.json")) as f:
        saved = json.load(f)["data_loader"]
    assert saved["consumed_samples"] == STOP * GBS and saved["sources"] == [corpus]

    resumes = run_on_ranks(4, _resumes_on_four_ranks, values, root)
    for name in ("dp4", "tp2xdp2"):
        resumed = _merged(resumes, name)
        assert "reading the stream from its start" not in resumed["log"], name  # the saved position was used
        assert sorted(resumed["samples"]) == list(range(STOP * GBS, ITERS * GBS)), name
        for i, row in resumed["samples"].items():
            np.testing.assert_array_equal(row, uninterrupted["samples"][i], err_msg=f"{name}: sample {i}")
        assert resumed["losses"] == pytest.approx(uninterrupted["losses"][STOP:], rel=1e-5), name
