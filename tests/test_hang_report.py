"""--hang-timeout-seconds: a rank that stops inside a step is named, with the collective the others wait in,
by every rank's report and one summary line; the job exits non-zero long before the process-group timeout,
and a restart resumes bitwise from the last checkpoint. A frozen rank (SIGSTOP: no thread of it runs), first,
middle or last, is named by a live one. No report fires while a save or an evaluation takes long.

Sleeping ranks run as forked ranks of the test server (tests/harness.run_entry_on_ranks); frozen ones under
real torchrun, whose agent serves the store that a frozen rank 0 would otherwise hold."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess

import pytest

from megatron_lite.config.arguments import make_config
from megatron_lite.errors import ConfigError
from megatron_lite.training.hang_report import hang_deadline, hang_summary
from tests.harness import EntryRun, run_entry_on_ranks
from tests.launching import children_of, kill_tree, torchrun_command, worker_rank

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


def test_the_summary_does_not_depend_on_which_rank_gathered_the_records():
    # TP2 x PP2, rank 3 asleep: rank 1 (pp) and rank 2 (tp) both wait for it; the first to report gathers the
    # records, its own first
    records = {0: _record("backward", op="send to rank 2", group="pp", count=29, inside=True, ranks=(0, 2)),
               1: _record("backward", op="send to rank 3", group="pp", count=29, inside=True, ranks=(1, 3)),
               2: _record("forward", op="all_reduce", group="tp", count=97, inside=True, ranks=(2, 3)),
               3: _record("forward of micro-batch 1 of 4", op="receive from rank 1", group="pp", count=28,
                          ranks=(1, 3))}
    summaries = {hang_summary({first: records[first], **records}, 4, 5) for first in records}
    assert len(summaries) == 1
    assert summaries.pop().startswith("no progress for 5 s (--hang-timeout-seconds): rank 1 of the 2 in the pp "
                                      "group is in send to rank 3 #29; rank 3 never entered it")


def test_a_rank_that_never_reported_is_named():
    waiting = _record("gradient reduction", op="all_reduce", group="dp", count=3, inside=True, ranks=(0, 1))
    assert hang_summary({0: waiting}, 2, 5).endswith("rank 1 did not report (dead, or stopped holding the "
                                                     "interpreter)")


def test_the_default_deadline_is_three_longest_steps_at_least_a_minute_and_at_most_half_the_group_timeout():
    values = {"model_preset": "llama-tiny", "mock_data": True, "distributed_timeout_minutes": 4}
    deadline = hang_deadline(make_config(values))
    assert deadline.seconds() == 60  # no step seen yet
    deadline.saw_step(15.0)
    deadline.saw_step(25.0)
    deadline.saw_step(5.0)
    assert deadline.seconds() == 75  # 3 x the longest step
    deadline.saw_step(50.0)
    assert deadline.seconds() == 120  # half the 4-minute process-group timeout
    given = hang_deadline(make_config({**values, "hang_timeout_seconds": 7}))
    given.saw_step(50.0)
    assert given.seconds() == 7
    assert hang_deadline(make_config({**values, "hang_timeout_seconds": 0})) is None
    with pytest.raises(ConfigError, match=r"--hang-timeout-seconds \(240\) must be below the process-group timeout"):
        make_config({**values, "hang_timeout_seconds": 240})


def _run(nproc: int, argv: list[str], sleep_rank: int | None = None, env: dict | None = None) -> EntryRun:
    """sleepy_pretrain.py on `nproc` forked ranks: the first non-zero exit status of a rank, every rank's output."""
    env = {"SLEEP_ITERATION": "4", **({"SLEEP_RANK": str(sleep_rank)} if sleep_rank is not None else {}), **(env or {})}
    runs = run_entry_on_ranks(nproc, argv, env, timeout=400, entry="tests.sleepy_pretrain")
    return EntryRun(next((run.code for run in runs if run.code), 0), "".join(run.stdout for run in runs),
                    "".join(run.stderr for run in runs))


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
    hung = _run(4, argv, sleep_rank=sleeper)
    assert hung.code != 0
    reports = sorted(set(re.findall(r"hang report \(rank (\d)\)", hung.stderr)))
    assert reports == ["0", "1", "2", "3"], hung.stderr[-3000:]
    assert "sleepy_pretrain.py" in hung.stderr and "time.sleep" in hung.stderr  # the sleeper's own stack
    summaries = [line for line in hung.stderr.splitlines() if re.match(r"error \(rank \d\): no progress", line)]
    assert len(summaries) == 1 and re.search(pattern, summaries[0]), hung.stderr[-3000:]
    assert max(_losses(metrics)) == 3

    resumed = _run(4, argv)
    assert resumed.code == 0, resumed.stderr[-3000:]
    reference = str(tmp_path / "reference.jsonl")
    uninterrupted = _run(4, TINY + layout + ["--metrics-jsonl", reference])
    assert uninterrupted.code == 0, uninterrupted.stderr[-3000:]
    assert _losses(metrics) == _losses(reference)


def _without(argv: list[str], flag: str) -> list[str]:
    """`argv` less `flag` and its value."""
    at = argv.index(flag)
    return argv[:at] + argv[at + 2:]


# every timeout at its default; the learning rate's schedule that of 60 iterations however many are run, so that a run
# frozen on its way to 60 can be checked by restarts of a few iterations against an uninterrupted run of as many
FROZEN_ARGV = _without(TINY, "--distributed-timeout-minutes") + ["--lr-decay-iters", "60"]


def _launch(argv: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(torchrun_command(4, SLEEPY, argv), cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1",
                            **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _freeze_after_iteration_5(process: subprocess.Popen, rank: int) -> dict[int, int]:
    """SIGSTOP global rank `rank` of a torchrun as soon as it logs iteration 5, inside iteration 6's step (the
    saves every 4 iterations are far: a rank frozen inside a save, which the watchdog does not watch, would be
    left to the process-group timeout); returns the workers by rank."""
    for line in process.stdout:
        logged = re.search(r"iteration +(\d+)/", line)
        if logged and int(logged[1]) >= 5:
            workers = {worker_rank(pid): pid for pid in children_of(process.pid)}
            os.kill(workers[rank], signal.SIGSTOP)
            return workers
    return {}


@pytest.mark.slow
def test_a_frozen_first_middle_or_last_rank_is_named_by_a_live_one_with_default_flags(tmp_path):
    """SIGSTOP (a hung host or device: no thread of the process runs) on rank 0, 2 or 3 of a DP4 run: a live
    rank prints the summary with the collective the others wait in and the frozen rank as the one that never
    reported, after the default deadline (a minute: the steps here are short); the job ends non-zero by itself,
    and a restart from the last checkpoint gives the losses of an uninterrupted run."""
    frozen_ranks = (0, 2, 3)
    runs = {}
    for rank in frozen_ranks:
        save, metrics = str(tmp_path / f"ckpt{rank}"), str(tmp_path / f"run{rank}.jsonl")
        argv = FROZEN_ARGV + ["--train-iters", "60", "--save", save, "--load", save, "--save-interval", "4",
                              "--metrics-jsonl", metrics]
        runs[rank] = (argv, metrics, _launch(argv, {"PACE_SECONDS": "0.3"}))
    try:
        with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:  # each frozen as soon as it logs iteration 5
            frozen = {rank: pool.submit(_freeze_after_iteration_5, process, rank)
                      for rank, (_, _, process) in runs.items()}
            for rank, workers in frozen.items():
                assert sorted(workers.result()) == [0, 1, 2, 3], (rank, workers.result())
        stderrs = {rank: process.communicate(timeout=400)[1] for rank, (_, _, process) in runs.items()}
    finally:
        for _, _, process in runs.values():
            kill_tree(process)
    for rank, (_, _, process) in runs.items():
        assert process.returncode != 0
        summaries = [line for line in stderrs[rank].splitlines() if "): no progress for" in line]
        assert len(summaries) == 1, stderrs[rank][-3000:]
        reporter = int(re.match(r"error \(rank (\d)\): ", summaries[0])[1])
        assert reporter != rank
        assert summaries[0].split(": ", 1)[1].startswith("no progress for 60 s (--hang-timeout-seconds): ")
        # The live ranks wait in the all-reduce the frozen one never finished; a rank it froze in the middle of a
        # ring all-reduce may have let some of them through to the next: each named where it waits.
        first = re.search(r"ranks? ([\d, ]+) of the 4 in the \S+ group (?:is|are) in all_reduce #(\d+)", summaries[0])
        assert first, summaries
        later = re.findall(r"rank (\d) waits in all_reduce #(\d+) over", summaries[0])
        assert sorted([int(r) for r in first[1].split(", ")] + [int(r) for r, _ in later]) == [
            r for r in range(4) if r != rank], summaries
        assert all(abs(int(count) - int(first[2])) == 1 for _, count in later), summaries
        assert summaries[0].endswith(f"rank {rank} did not report (dead, or stopped holding the interpreter)")
    reference = str(tmp_path / "reference.jsonl")
    for argv in [*(argv + ["--train-iters", "8"] for argv, _, _ in runs.values()),
                 FROZEN_ARGV + ["--train-iters", "8", "--metrics-jsonl", reference]]:
        run = _run(4, argv)  # the restarts to iteration 8, then the uninterrupted run: plain runs, on forked ranks
        assert run.code == 0, run.stderr[-3000:]
    for _, metrics, _ in runs.values():
        assert _losses(metrics) == _losses(reference)


@pytest.mark.slow
def test_no_report_fires_during_a_long_save_or_a_long_evaluation(tmp_path):
    """With a 3 s deadline: each checkpoint save takes 5 s more, and each evaluation 5 forwards of 0.8 s (the
    record moves with every one of them); the run finishes, exit 0, with no hang report."""
    save = str(tmp_path / "ckpt")
    argv = _without(TINY, "--eval-interval") + [
        "--train-iters", "4", "--save", save, "--save-interval", "2", "--eval-interval", "2", "--eval-iters", "5",
        "--hang-timeout-seconds", "3"]
    run = _run(4, argv, env={"SAVE_SECONDS": "5", "PACE_SECONDS": "0.8"})
    assert run.code == 0, run.stderr[-3000:]
    assert "hang report" not in run.stderr and "no progress" not in run.stderr
