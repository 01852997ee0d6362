"""Launching real torchrun worlds from tests, each on a port of its own: launches in two test workers
(pytest-xdist) must never meet on torchrun's default port, 29500."""

from __future__ import annotations

import socket
import sys

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
