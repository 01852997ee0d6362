"""When a run stops before --train-iters: SIGTERM, --exit-interval, --exit-duration-in-mins.

A cluster scheduler sends SIGTERM some time before it kills a job; with --exit-signal-handler the signal
only sets a flag, and at the next iteration boundary the ranks agree (an all-reduce of the flags: the
signal may reach a single rank) to save a checkpoint and exit cleanly. The time limit is agreed the same
way, since clocks and start times differ between ranks; the iteration limit needs no agreement.
"""

from __future__ import annotations

import signal
import time

import torch

from megatron_lite.config.sections import Config
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


class ExitSignalHandler:
    """Within the `with` block, SIGTERM sets `received` instead of terminating the process."""

    def __init__(self, enabled: bool, signum: int = signal.SIGTERM):
        self.enabled = enabled
        self.signum = signum
        self.received = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.received = True

    def __enter__(self) -> ExitSignalHandler:
        if self.enabled:
            self._previous = signal.signal(self.signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(self.signum, self._previous)


class ExitConditions:
    """Decides, identically on every rank, whether to stop after an iteration and why."""

    def __init__(self, config: Config, pstate: ParallelState, device: torch.device, handler: ExitSignalHandler):
        self.training = config.training
        self.pstate = pstate
        self.device = device
        self.handler = handler
        self.start_time = time.monotonic()

    def reason(self, iteration: int) -> str | None:
        """Why to stop after `iteration` completed iterations, or None to continue (collective)."""
        t = self.training
        if t.exit_signal_handler or t.exit_duration_in_mins is not None:
            minutes = (time.monotonic() - self.start_time) / 60
            flags = torch.tensor([float(self.handler.received),
                                  float(t.exit_duration_in_mins is not None and minutes > t.exit_duration_in_mins)],
                                 device=self.device)
            mappings.all_reduce(flags, self.pstate.group("world"), op=torch.distributed.ReduceOp.MAX)
            if flags[0] > 0:
                return "exit signal received"
            if flags[1] > 0:
                return f"exit duration of {t.exit_duration_in_mins} minutes reached"
        if t.exit_interval and iteration % t.exit_interval == 0:
            return f"exit interval of {t.exit_interval} iterations reached"
        return None
