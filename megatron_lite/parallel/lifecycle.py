"""Joining and leaving the default process group: timeouts, a start-up barrier, a deterministic teardown.

Joining: every group gets `--distributed-timeout-minutes` (torch's default is 30 minutes, and subgroups
do not inherit the default group's), so a stuck rank ends the run instead of stalling it. Before the first
step a monitored barrier names the ranks that never finished starting up.

Leaving: gloo's worker threads may hold the last reference to a finished collective's work object; if
they drop it while the interpreter finalizes, the process aborts ("terminate called without an active
exception") and a finished run exits non-zero. `shutdown` therefore collects the reference cycles that
keep work handles alive and destroys the process groups (which joins those threads) while Python is
still fully alive, on every exit path.
"""

from __future__ import annotations

import datetime
import gc
import re

import torch
import torch.distributed as dist

from megatron_lite.errors import UserError


class CollectiveTimeoutError(UserError, RuntimeError):
    """A collective or the start-up barrier waited longer than --distributed-timeout-minutes."""


def timeout_of(minutes: float) -> datetime.timedelta:
    return datetime.timedelta(minutes=minutes)


def join(device: torch.device, timeout: datetime.timedelta) -> None:
    """Join the process group torchrun describes, unless this process is already in one."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)


def startup_barrier(timeout: datetime.timedelta) -> None:
    """Wait for every rank to finish starting up; name the ranks that did not within `timeout`.

    torch's monitored barrier exists for gloo only, so NCCL runs use a gloo group of their own for it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as error:
        missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(error))
        who = f"rank(s) {missing.group(1).strip()}" if missing else "some ranks"
        raise CollectiveTimeoutError(
            f"{who} did not finish starting up within {_minutes(timeout)} (--distributed-timeout-minutes): "
            f"they are stuck or dead") from error


def as_timeout_error(error: BaseException, timeout_minutes: float) -> CollectiveTimeoutError | None:
    """The one-line form of a backend's collective timeout, or None for any other error."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not re.search(r"[Tt]imed out|[Tt]imeout", text):
        return None
    return CollectiveTimeoutError(
        f"a collective waited longer than {timeout_minutes:g} min (--distributed-timeout-minutes): another rank "
        f"is stuck or dead ({text.splitlines()[0][-160:]})")


def shutdown(owns_default_group: bool) -> None:
    """Release outstanding work handles and destroy the process groups this run created.

    Destroying the default group destroys every subgroup with it. A run that joined a group someone else
    created (a test harness) leaves it alone."""
    gc.collect()
    if owns_default_group and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _minutes(timeout: datetime.timedelta) -> str:
    return f"{timeout.total_seconds() / 60:g} min"
