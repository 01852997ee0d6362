"""Where this process is: its iteration, its step within it, and the last collective it entered and left.

The hang watchdog (training/hang_report.py) reads the record from its own thread when nothing has changed for
--hang-timeout-seconds, and the ranks' records together say who waits in which collective and who never
entered it. The record describes the process, not a layout (like faulthandler's state), so there is one per
process: `RECORD`. Collectives count per group, so the n-th collective over a group is the same call on every
rank of it. Updating costs a few attribute writes per collective and per micro-batch step.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist


class Progress:
    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget earlier runs of this process (their groups may be gone, their ids reused)."""
        self.iteration: int | None = None
        self.step = "start-up"  # 'forward of micro-batch 2', 'optimizer', ...
        self.op: str | None = None  # the last collective
        self.group: int | None = None  # id() of its group: the record keeps no group alive
        self.count = 0  # its number among this group's collectives
        self.inside = False  # entered and not yet left
        self.counts: dict[int, int] = {}  # id(group) -> collectives entered
        self.group_ranks: dict[int, list[int]] = {}  # id(group) -> its global ranks, read once per group
        self.changed = time.monotonic()

    def _touch(self) -> None:
        self.changed = time.monotonic()

    def set_step(self, step: str, iteration: int | None = None) -> None:
        with self._lock:
            self.step = step
            if iteration is not None:
                self.iteration = iteration
            self._touch()

    @torch.compiler.disable
    def enter(self, op: str, group, count: int | None = None) -> int:
        """Record being inside collective `op` over `group`: the group's next one, or number `count` (the wait
        on a collective started before); returns its number."""
        with self._lock:
            key = id(group)
            if count is None:
                count = self.counts[key] = self.counts.get(key, 0) + 1
            if key not in self.group_ranks:
                self.group_ranks[key] = _global_ranks(group)
            self.op, self.group, self.count, self.inside = op, key, count, True
            self._touch()
            return count

    @torch.compiler.disable
    def leave(self) -> None:
        with self._lock:
            self.inside = False
            self._touch()

    @contextlib.contextmanager
    def collective(self, op: str, group, count: int | None = None):
        self.enter(op, group, count)
        try:
            yield
        finally:
            self.leave()

    def started(self, op: str, group, work):
        """`work` of an asynchronous collective just started: waiting on it counts as being inside it."""
        count = self.enter(op, group)
        self.leave()
        return RecordedWork(work, self, op, group, count) if work is not None else None

    def idle_seconds(self) -> float:
        return time.monotonic() - self.changed

    def snapshot(self) -> dict:
        """The record as plain values; `group` is the group's id() (naming it is the reader's)."""
        with self._lock:
            return {"iteration": self.iteration, "step": self.step, "op": self.op, "group": self.group,
                    "group_ranks": self.group_ranks.get(self.group, []), "count": self.count,
                    "inside": self.inside, "idle_s": self.idle_seconds()}


def _global_ranks(group) -> list[int]:
    """The group's global ranks; none for what torch does not know as a group (a test's stand-in)."""
    try:
        return dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return []


class RecordedWork:
    """A started collective's work object; its `wait` is recorded as time inside that collective."""

    def __init__(self, work, record: Progress, op: str, group, count: int):
        self._work, self._record, self._op, self._group, self._count = work, record, op, group, count

    def wait(self, *args, **kwargs):
        with self._record.collective(self._op, self._group, self._count):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


RECORD = Progress()
