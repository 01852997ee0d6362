"""Launching real torchrun worlds from tests, each on a port of its own (launches in two test workers,
pytest-xdist, must never meet on torchrun's default port, 29500), and finding, waiting for and killing their
workers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

_TAKEN: set[int] = set()  # ports handed out: a launched torchrun binds its own only later


def free_port() -> int:
    """A port nothing listens on now and this process has not handed out before."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _TAKEN:
            _TAKEN.add(port)
            return port


def torchrun_command(nproc: int, script: str, argv: list[str], torchrun_args: tuple[str, ...] = ()) -> list[str]:
    """`python -m torch.distributed.run` of `script` on `nproc` local ranks, its store on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
            str(free_port()), *torchrun_args, script, *argv]


def children_of(pid: int) -> list[int]:
    """Child processes of `pid` (a torchrun's: its workers), in the order of their pids."""
    children = []
    with contextlib.suppress(FileNotFoundError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(child) for child in f.read().split()]
    return sorted(children)


def worker_rank(pid: int) -> int | None:
    """The RANK torchrun gave worker `pid`, or None while it is still its launcher's forked copy: until it execs,
    a worker has the launcher's command line (which names the script too) and environment (no RANK)."""
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/environ", "rb") as f:
        variables = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(variables[b"RANK"]) if b"RANK" in variables else None
    return None


def wait_for_exit(pid: int, timeout: float) -> None:
    """Wait until process `pid` has ended (exited, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still runs after {timeout} s")


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a torchrun and its workers at once (torchrun starts each worker in a session of its own, so
    killing its process group would leave them to notice their launcher's death by themselves)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for member in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(signal.SIGKILL)
    process.wait()
