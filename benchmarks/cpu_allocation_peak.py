"""The peak of the CPU allocator's running total while a function runs, on a gloo rank.

torch.profiler (profile_memory) records every allocation and free of the CPU allocator made by a thread it
follows. gloo's worker threads are not followed, and a collective's work object holds references to its
tensors until a worker thread releases it, moments after the collective completes. When that release is the
last reference, the free is done by the worker thread and never recorded, so a plain running total of the
recorded events only grows by each such block (a tensor all-reduced then dropped at once, a gradient sent to
the previous pipeline stage, the copy gloo's reduce-scatter makes of its input). Two things make the total
exact:
  - while measuring, every collective and point-to-point call waits, after it completes, until gloo has
    dropped its references to the call's tensors (TensorImpl use counts back to what they were before), so
    that the framework's own reference is the last and its free is recorded on the calling thread;
  - the blocks a collective allocated for itself (gloo's reduce-scatter copies its input; NCCL does not) are
    released by gloo alone: a block allocated inside a c10d operation whose free was not recorded is counted
    as freed when that operation returned.
A free of any other block that the profiler missed would show as an allocation at an address still live, or
as a block never freed; `measure_peak` counts those (`unrecorded_frees`) so that a run can show there were none.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

_COMMUNICATING = ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
                  "reduce_scatter_tensor", "all_to_all_single", "isend", "irecv")
_RELEASE_TIMEOUT_S = 30.0


def _wait_until_released(tensors: list[torch.Tensor], counts: list[int]) -> None:
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while any(tensor._use_count() > count for tensor, count in zip(tensors, counts)):
        if time.monotonic() > deadline:
            raise RuntimeError("gloo kept a reference to a communicated tensor for 30 s")
        time.sleep(0)


class _ReleasingWork:
    """An asynchronous call's work whose wait() also waits for gloo to drop the call's tensors."""

    def __init__(self, work, tensors: list[torch.Tensor], counts: list[int]):
        self._work, self._tensors, self._counts = work, tensors, counts

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        self._work = None  # a work object holds its tensors until it is destroyed
        _wait_until_released(self._tensors, self._counts)
        self._tensors = None
        return result


def _releasing(function):
    def call(*args, **kwargs):
        tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]
        counts = [tensor._use_count() for tensor in tensors]
        work = function(*args, **kwargs)
        if work is None:
            _wait_until_released(tensors, counts)
            return None
        return _ReleasingWork(work, tensors, counts)
    return call


@contextlib.contextmanager
def _collectives_released_by_caller():
    originals = {name: getattr(dist, name) for name in _COMMUNICATING if hasattr(dist, name)}
    try:
        for name, function in originals.items():
            setattr(dist, name, _releasing(function))
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def _recorded_events(function) -> list[dict]:
    with _collectives_released_by_caller(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        function()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "trace.json")
        profile.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def measure_peak(function) -> tuple[int, int]:
    """(peak, unrecorded_frees): the highest running total of the CPU allocator's allocations minus their frees
    while `function` runs (frees of blocks that existed before it count too), and how many frees the profiler
    missed outside collectives (0 in a clean measurement)."""
    events = _recorded_events(function)
    memory = sorted((event for event in events if event.get("name") == "[memory]"),
                    key=lambda event: (event["ts"], event["args"]["Bytes"]))
    if not memory:
        return 0, 0
    caller = memory[0]["tid"]
    collectives = sorted((event["ts"], event["ts"] + event["dur"]) for event in events
                         if event.get("ph") == "X" and event["tid"] == caller and event["name"].startswith("c10d::"))
    starts = [start for start, _ in collectives]

    def collective_end(ts: float) -> float | None:
        index = bisect.bisect_right(starts, ts) - 1
        return collectives[index][1] if index >= 0 and collectives[index][1] >= ts else None

    changes, live, unrecorded = [], {}, 0

    def release_unrecorded(allocation: dict) -> None:
        nonlocal unrecorded
        end = collective_end(allocation["ts"])
        if end is None:
            unrecorded += 1  # left in the total: an over-estimate, counted so that it shows
        else:
            changes.append((end, -allocation["args"]["Bytes"]))

    for event in memory:
        address, size = event["args"]["Addr"], event["args"]["Bytes"]
        changes.append((event["ts"], size))
        if size > 0:
            if address in live:
                release_unrecorded(live[address])
            live[address] = event
        else:
            live.pop(address, None)
    for allocation in live.values():
        if collective_end(allocation["ts"]) is not None:
            release_unrecorded(allocation)
    total = peak = 0
    for _, change in sorted(changes):
        total += change
        peak = max(peak, total)
    return peak, unrecorded
