"""A run ends the way it should: exit 0 when it finished, one line and a non-zero exit when it cannot go on
(a diverged loss, a stuck rank), and nothing wrong saved."""

import contextlib
import datetime
import os
import signal
import subprocess
import tempfile
import time

import pytest
import torch

from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors
from tests.harness import process_context
from tests.launching import children_of, torchrun_command, wait_for_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("idle_machine")
TINY = ["--model-preset", "llama-tiny", "--mock-data", "--num-layers", "1", "--hidden-size", "32",
        "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32", "--vocab-size", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4"]


def _torchrun(argv: list[str], torchrun_args: tuple[str, ...] = ()) -> subprocess.Popen:
    command = torchrun_command(2, "pretrain_gpt.py", argv, torchrun_args)
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error (rank")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ten_finished_two_rank_runs_all_exit_zero():
    """Ten whole torchrun worlds start, train and end; two at a time, each on its own port, so that one run's
    imports overlap the other's start-up and teardown."""
    failures = []
    for pair in range(5):
        processes = [_torchrun(TINY + ["--train-iters", "2"])
                     for _ in range(2)]
        for attempt, process in enumerate(processes, start=2 * pair):
            _, stderr = process.communicate(timeout=300)
            if process.returncode != 0:
                failures.append((attempt, process.returncode, stderr[-600:]))
    assert not failures, failures


def test_a_diverging_run_stops_before_the_bad_step_and_keeps_the_last_good_checkpoint(tmp_path):
    save = str(tmp_path / "ckpt")
    process = _torchrun(TINY + ["--train-iters", "20", "--lr", "1e30", "--lr-warmup-iters", "0", "--save", save,
                                "--save-interval", "1", "--keep-last-n", "1"])
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    lines = _error_lines(stderr)
    assert sorted(line.split(")")[0] for line in lines) == ["error (rank 0", "error (rank 1"], stderr[-2000:]
    assert all("the step was not applied" in line for line in lines), lines
    assert 'pretrain_gpt.py", line' not in stderr  # no traceback from the ranks (torchrun prints its own)
    failed_at = int(lines[0].split("iteration ")[1].split(":")[0])
    assert directory.latest_iteration(save) == failed_at - 1  # the last good one, kept by --keep-last-n
    for iteration in directory.complete_iterations(save):
        tensors = read_checkpoint_tensors(directory.checkpoint_path(save, iteration))
        assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())


def test_a_stopped_rank_ends_the_run_within_the_distributed_timeout():
    # the process-group timeout itself, without the hang report that would come first (tests/test_hang_report.py)
    process = _torchrun(TINY + ["--train-iters", "100000", "--distributed-timeout-minutes", "0.2",
                                "--hang-timeout-seconds", "0"])
    workers = []
    try:
        for line in process.stdout:
            if "iteration      2/" in line:
                break
        workers = children_of(process.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGSTOP)
        wait_for_exit(workers[0], timeout=300)  # the 12 s timeout must end it, not this limit
        # torchrun would give the stopped rank its 30 s grace after SIGTERM, which a stopped process never acts on
        os.kill(workers[1], signal.SIGKILL)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert process.returncode != 0
    lines = _error_lines(stderr)
    assert len(lines) == 1 and "--distributed-timeout-minutes" in lines[0], stderr[-2000:]


def _startup_rank(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist

    from megatron_lite.errors import UserError
    from megatron_lite.parallel import lifecycle

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 1:  # stuck in start-up: never reaches the barrier
        time.sleep(8)
        return
    try:
        lifecycle.startup_barrier(datetime.timedelta(seconds=2))
        results.put("passed")
    except UserError as error:
        results.put(str(error))


def test_the_startup_barrier_names_the_ranks_that_never_arrive():
    context = process_context()
    results = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        processes = [context.Process(target=_startup_rank, args=(rank, os.path.join(tmp, "init"), results))
                     for rank in range(2)]
        for process in processes:
            process.start()
        message = results.get(timeout=60)
        processes[1].kill()  # stuck by design: its sleep need not be waited out once rank 0 has reported
        for process in processes:
            process.join(timeout=30)
    assert message.startswith("rank(s) 1 did not finish starting up within"), message
    assert "--distributed-timeout-minutes" in message
