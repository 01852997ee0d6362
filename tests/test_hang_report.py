"""--hang-timeout-seconds: a rank that stops inside a step is named, with the collective the others wait in,
by every rank's report and one summary line; the job exits non-zero long before the process-group timeout,
and a restart resumes bitwise from the last checkpoint."""

import json
import os
import re
import subprocess

import pytest

from megatron_lite.config.arguments import make_config
from megatron_lite.errors import ConfigError
from megatron_lite.training.hang_report import hang_summary, hang_timeout_s
from tests.launching import torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model-preset", "llama-tiny", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
        "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "16", "--max-position-embeddings",
        "16", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "5",
        "--log-interval", "1", "--eval-interval", "1000", "--distributed-timeout-minutes", "2"]
SLEEPY = os.path.join(ROOT, "tests", "sleepy_pretrain.py")


def _record(step, iteration=4, op=None, group=None, count=0, inside=False, ranks=()):
    return {"step": step, "iteration": iteration, "op": op, "group": group, "count": count, "inside": inside,
            "group_ranks": list(ranks)}


def test_the_summary_names_the_rank_that_never_entered_the_collective():
    waiting = _record("gradient reduction", op="all_reduce", group="dp", count=9, inside=True, ranks=range(4))
    records = {0: waiting, 1: waiting, 2: waiting,
               3: _record("forward of micro-batch 2 of 4", op="all_reduce", group="dp", count=8, ranks=range(4))}
    assert hang_summary(records, 4, 60) == (
        "no progress for 60 s (--hang-timeout-seconds): ranks 0, 1, 2 of the 4 in the dp group are in all_reduce #9; "
        "rank 3 never entered it: its last step was forward of micro-batch 2 of 4 of iteration 4, its last "
        "collective all_reduce #8 over the dp group")


def test_the_summary_starts_from_the_collective_held_up_by_a_rank_waiting_nowhere():
    # TP2 x PP2: rank 3 sleeps; its TP peer 2 waits for it; stage 0 (ranks 0, 1) waits for stage 1's gradients
    records = {0: _record("backward", op="receive from rank 2", group="pp", count=5, inside=True, ranks=(0, 2)),
               1: _record("backward", op="receive from rank 3", group="pp", count=5, inside=True, ranks=(1, 3)),
               2: _record("forward", op="all_reduce", group="tp", count=30, inside=True, ranks=(2, 3)),
               3: _record("forward of micro-batch 1 of 2", op="all_reduce", group="tp", count=29, ranks=(2, 3))}
    summary = hang_summary(records, 4, 5)
    # ranks 1 and 2 both wait for rank 3; rank 0 waits for rank 2, which waits itself: not the one to name first
    assert summary.startswith("no progress for 5 s (--hang-timeout-seconds): rank 1 of the 2 in the pp group is "
                              "in receive from rank 3 #5; rank 3 never entered it: its last step was forward of "
                              "micro-batch 1 of 2 of iteration 4")
    assert summary.endswith("rank 0 waits in receive from rank 2 #5 over the pp group; rank 2 waits in all_reduce "
                            "#30 over the tp group")


def test_a_rank_that_never_reported_is_named():
    waiting = _record("gradient reduction", op="all_reduce", group="dp", count=3, inside=True, ranks=(0, 1))
    assert hang_summary({0: waiting}, 2, 5).endswith("rank 1 did not report (dead, or stopped holding the "
                                                     "interpreter)")


def test_the_timeout_defaults_to_half_the_process_group_timeout_and_must_stay_below_it():
    values = {"model_preset": "llama-tiny", "mock_data": True, "distributed_timeout_minutes": 4}
    assert hang_timeout_s(make_config(values)) == 120
    assert hang_timeout_s(make_config({**values, "hang_timeout_seconds": 0})) == 0
    with pytest.raises(ConfigError, match=r"--hang-timeout-seconds \(240\) must be below the process-group timeout"):
        make_config({**values, "hang_timeout_seconds": 240})


def _torchrun(nproc: int, argv: list[str], sleep_rank: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLEEP_ITERATION": "4"}
    if sleep_rank is not None:
        env["SLEEP_RANK"] = str(sleep_rank)
    command = torchrun_command(nproc, SLEEPY, argv)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def _losses(path) -> dict[int, float]:
    with open(path) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("layout, sleeper, pattern", [
    ([], 3,
     r"ranks 0, 1, 2 of the 4 in the \S+ group are in \w+ #\d+; rank 3 never entered it: its last step was forward "
     r"of micro-batch 1 of 1 of iteration 4"),
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 3,
     r"rank [12] of the 2 in the \w+ group is in [\w ]+ #\d+; rank 3 never entered it: its last step was "
     r"forward of micro-batch 1 of 4 of iteration 4"),
], ids=["dp4", "tp2_pp2"])
def test_a_sleeping_rank_is_named_the_job_exits_and_a_restart_resumes_bitwise(layout, sleeper, pattern, tmp_path):
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    argv = TINY + layout + ["--save", save, "--load", save, "--save-interval", "1", "--metrics-jsonl", metrics,
                            "--hang-timeout-seconds", "5"]
    hung = _torchrun(4, argv, sleep_rank=sleeper)
    assert hung.returncode != 0
    reports = sorted(set(re.findall(r"hang report \(rank (\d)\)", hung.stderr)))
    assert reports == ["0", "1", "2", "3"], hung.stderr[-3000:]
    assert "sleepy_pretrain.py" in hung.stderr and "time.sleep" in hung.stderr  # the sleeper's own stack
    summaries = [line for line in hung.stderr.splitlines() if line.startswith("error (rank 3): no progress")]
    assert len(summaries) == 1 and re.search(pattern, summaries[0]), hung.stderr[-3000:]
    assert max(_losses(metrics)) == 3

    resumed = _torchrun(4, argv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = str(tmp_path / "reference.jsonl")
    uninterrupted = _torchrun(4, TINY + layout + ["--metrics-jsonl", reference])
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    assert _losses(metrics) == _losses(reference)
