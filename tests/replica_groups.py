"""Launching pretrain_gpt.py replica groups and torchft's lighthouse as separate processes, as a user does: for
tests/test_fault_tolerance.py and benchmarks/fault_tolerance.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.launching import free_port, kill_tree

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TINY = ["--model-preset", "llama-tiny", "--mock-data", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size",
        "128", "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "256", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--lr", "3e-3", "--eval-interval", "100000",
        "--device", "cpu", "--hidden-dropout", "0", "--attention-dropout", "0"]
def environment() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def lighthouse(min_replicas: int) -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse, quick to notice a dead group (1 s without heartbeats), and its address, once it
    listens."""
    port = free_port()
    process = subprocess.Popen([str(BIN / "torchft_lighthouse"), "--min_replicas", str(min_replicas),
                                "--join_timeout_ms", "1000", "--quorum_tick_ms", "20", "--heartbeat_timeout_ms",
                                "1000", "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=environment())

    def listening() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("localhost", port), timeout=1):
            return True
        return False

    wait_for(listening, 30, "the lighthouse to listen")
    return process, f"http://localhost:{port}"


@contextlib.contextmanager
def agent_stores(count: int):
    """`count` TCPStores served from this process, as torchrun's agent serves one to its workers; yields for each
    the variables that point a group's ranks at it (forked ranks of one group then find their store, and torchft
    its own, as under torchrun, also in a group of one rank)."""
    import torch.distributed as dist

    ports = [free_port() for _ in range(count)]
    stores = [dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False) for port in ports]
    yield [{"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"} for port in ports]
    del stores


def torchrun(nproc: int, flags: list[str], log: Path, pace: float = 0.0) -> subprocess.Popen:
    """pretrain_gpt.py of the tiny model under torchrun (`kill_tree` kills it with its workers); with `pace`,
    each forward first sleeps that many seconds (tests/sleepy_pretrain.py)."""
    command = [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-port", str(free_port()),
               str(ROOT / "tests" / "sleepy_pretrain.py"), *TINY, *flags]
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**environment(), "PACE_SECONDS": str(pace)})


def group_flags(group: int, lighthouse_address: str, root: Path, iters: int, run: str = "",
                batch: int = 2) -> list[str]:
    """Replica group `group` of two, with --global-batch-size `batch`, logging every step to
    root/group<G><run>.jsonl and saving at the end to root/ckpt<G>."""
    return ["--fault-tolerance", "torchft", "--ft-replica-id", str(group), "--ft-num-replica-groups", "2",
            "--ft-lighthouse", lighthouse_address, "--global-batch-size", str(batch), "--train-iters", str(iters),
            "--log-interval", "1", "--metrics-jsonl", str(root / f"group{group}{run}.jsonl"),
            "--save", str(root / f"ckpt{group}"), "--save-interval", "100000"]


@contextlib.contextmanager
def killed_at_exit(*processes: subprocess.Popen):
    """A list of processes (these, and those appended to it) each killed with its workers at the end if it is
    still running: a failing test leaves nothing behind."""
    launched = list(processes)
    try:
        yield launched
    finally:
        for process in launched:
            if process.poll() is None:
                kill_tree(process)


def records(path: Path) -> list[dict]:
    """The complete lines of a metrics JSONL file being written."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the last piece may be a line still being written
    return [json.loads(line) for line in lines if line.strip()]


def wait_for(condition, timeout: float, what: str, poll: float = 0.01):
    """Poll `condition` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(poll)


def finish(processes: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> None:
    """Wait for every process; each must exit 0 (else its log's end is the error)."""
    deadline = time.monotonic() + timeout
    for process, log in zip(processes, logs):
        status = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        if status != 0:
            raise AssertionError(log.read_text()[-3000:])
