"""Where a training step's time goes: forward-backward, gradient reduction, optimizer, waiting for data.

On a GPU the compute phases are timed with CUDA events recorded on the current stream, so timing adds no
host synchronisation; they are read once per iteration, after the logger has synchronised anyway. Waiting
for data is host time (how long `next(data_iterator)` blocked), so it is measured on the host clock.
Seconds are summed per phase until `read` is called.
"""

from __future__ import annotations

import contextlib
import time

import torch

PHASES = ("forward_backward", "grad_reduce", "optimizer", "data_wait")


class PhaseTimers:
    """Accumulates the time of each named phase of the steps since the last `read`."""

    def __init__(self, device: torch.device):
        self.on_gpu = device.type == "cuda"
        self.host_seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time the block as `name`: with CUDA events for device work, else on the host clock."""
        if self.on_gpu and name != "data_wait":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((name, start, end))
            return
        begin = time.perf_counter()
        yield
        self.host_seconds[name] += time.perf_counter() - begin

    def timed_iterator(self, iterator):
        """`iterator`, with the time each `next` blocks counted as data_wait."""
        if iterator is None:
            return None
        while True:
            with self.phase("data_wait"):
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    def read(self) -> dict[str, float]:
        """Milliseconds per phase since the last read (the GPU must have finished the timed work)."""
        seconds = dict(self.host_seconds)
        for name, start, end in self.events:
            seconds[name] += start.elapsed_time(end) / 1e3
        self.host_seconds = dict.fromkeys(PHASES, 0.0)
        self.events = []
        return {f"time_{name}_ms": 1e3 * value for name, value in seconds.items()}
