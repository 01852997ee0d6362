"""Joining and leaving the default process group: timeouts, a start-up barrier, a deterministic teardown.

Joining: every group gets `--distributed-timeout-minutes` (torch's default is 30 minutes, and subgroups
do not inherit the default group's), so a stuck rank ends the run instead of stalling it. Ranks that never
join the process group, and, before the first step, ranks that never finish starting up, are named, as stuck
or, when they died, as exited.

Leaving: gloo's worker threads may hold the last reference to a finished collective's work object; if
they drop it while the interpreter finalizes, the process aborts ("terminate called without an active
exception") and a finished run exits non-zero. `shutdown` therefore collects the reference cycles that
keep work handles alive and destroys the process groups (which joins those threads) while Python is
still fully alive, on every exit path.
"""

from __future__ import annotations

import datetime
import gc
import os
import re
import time

import torch
import torch.distributed as dist

from megatron_lite.errors import UserError


class CollectiveTimeoutError(UserError, RuntimeError):
    """A collective or the start-up barrier waited longer than --distributed-timeout-minutes."""


class PeerLostError(UserError, RuntimeError):
    """Another rank closed its connections during a collective: it died, and its own log says why."""


def timeout_of(minutes: float) -> datetime.timedelta:
    return datetime.timedelta(minutes=minutes)


def join(device: torch.device, timeout: datetime.timedelta) -> None:
    """Join the process group the launcher describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), unless this
    process is already in one.

    Every rank first records its arrival in the store and waits there for the others: a rank that never
    starts (a GPU that hangs, an import stuck on a file system) is then named, where torch's own env://
    set-up would time out counting clients or naming a store key."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = _store(rank, world_size, timeout)
    _wait_for_every_rank(store, rank, world_size, timeout)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timeout)


def _store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The env:// store: torchrun's agent hosts it when it says so (TORCHELASTIC_USE_AGENT_STORE), else rank 0.
    Its host does not wait for the others to connect: `_wait_for_every_rank` does, and names the missing."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise UserError(f"WORLD_SIZE is {world_size} but MASTER_ADDR and MASTER_PORT are not both set: launch with "
                        f"torchrun, or set them to rank 0's host and a free port")
    is_host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        return dist.TCPStore(host, int(port), world_size, is_host, timeout, wait_for_workers=False)
    except RuntimeError as error:  # nobody answered at host:port
        if is_host or not _is_timeout(error):
            raise
        raise CollectiveTimeoutError(f"rank(s) 0 did not join the process group within {_minutes(timeout)} "
                                     f"(--distributed-timeout-minutes): it is stuck or dead, or MASTER_ADDR:"
                                     f"MASTER_PORT ({host}:{port}) is not where it listens") from error


def _wait_for_every_rank(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    keys = [f"megatron_lite/arrived/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except RuntimeError as error:
        missing = ", ".join(str(r) for r, key in enumerate(keys) if not store.check([key]))
        raise CollectiveTimeoutError(f"rank(s) {missing} did not join the process group within {_minutes(timeout)} "
                                     f"(--distributed-timeout-minutes): they are stuck or dead") from error


def startup_barrier(timeout: datetime.timedelta) -> None:
    """Wait for every rank to finish starting up; name the ranks that did not within `timeout`.

    torch's monitored barrier exists for gloo only, so NCCL runs use a gloo group of their own for it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    start = time.monotonic()
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as error:
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(error))
        who = f"rank(s) {missing.group(1).strip()}" if missing else "some ranks"
        raise startup_failure(who, time.monotonic() - start, timeout) from error


def startup_failure(who: str, waited_s: float, timeout: datetime.timedelta) -> UserError:
    """The barrier fails at once when a rank's connection closes (the rank exited: its own log says why), and
    only after `timeout` when a rank is alive but stuck."""
    if waited_s < 0.9 * timeout.total_seconds():
        return PeerLostError(f"{who} exited during start-up, after {waited_s:.0f} s (see their own error above)")
    return CollectiveTimeoutError(f"{who} did not finish starting up within {_minutes(timeout)} "
                                  f"(--distributed-timeout-minutes): they are stuck")


def as_timeout_error(error: BaseException, timeout_minutes: float) -> CollectiveTimeoutError | None:
    """The one-line form of a backend's collective timeout, or None for any other error."""
    text = str(error)
    if not _is_timeout(error):
        return None
    return CollectiveTimeoutError(
        f"a collective waited longer than {timeout_minutes:g} min (--distributed-timeout-minutes): another rank "
        f"is stuck or dead ({text.splitlines()[0][-160:]})")


def as_peer_lost_error(error: BaseException) -> PeerLostError | None:
    """The one-line form of gloo's error when the rank at the other end of a collective died (with that rank's
    address), or None."""
    lost = re.search(r"(\[[^\]]*\]:\d+: )?(Connection (reset|closed) by peer|Broken pipe)( \[[^\]]*\]:\d+)?",
                     str(error))
    if not isinstance(error, RuntimeError) or lost is None:
        return None
    return PeerLostError(f"another rank died during a collective ({lost.group(0)})")


def report_store(timeout: datetime.timedelta | None) -> dist.Store | None:
    """A new client of the launcher's store (MASTER_ADDR:MASTER_PORT), or None without one. Reports that must
    get through while collectives hang use it: the store is served apart from the process group's
    connections."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (dist.is_initialized() and host and port):
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timeout or datetime.timedelta(minutes=10),
                         wait_for_workers=False)


def world_group() -> dist.ProcessGroup | None:
    """The default group when this process has joined one of more than one rank, else None (no collective
    needed)."""
    return dist.group.WORLD if dist.is_initialized() and dist.get_world_size() > 1 else None


def shutdown(owns_default_group: bool) -> None:
    """Release outstanding work handles and destroy the process groups this run created.

    Destroying the default group destroys every subgroup with it. A run that joined a group someone else
    created (a test harness) leaves it alone."""
    gc.collect()
    if owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _is_timeout(error: BaseException) -> bool:
    return isinstance(error, RuntimeError) and re.search(r"[Tt]imed out|[Tt]imeout", str(error)) is not None


def _minutes(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds() / 60:g} min"
