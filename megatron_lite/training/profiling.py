"""--profile: a torch profiler trace of chosen training steps on chosen ranks, for Perfetto or chrome://tracing.

As Megatron's --profile with --use-pytorch-profiler: the steps from --profile-step-start N to
--profile-step-end M (not included), counted as Megatron's loop counts them, from 0 by the iterations done
before the step (step N is logged as iteration N+1), on each rank of --profile-ranks (default rank 0).
The profiler records from the step before N on, to warm itself up, and keeps steps N to M-1 only. Each
profiled rank writes one Chrome trace JSON, `rank<R>.pt.trace.json`, into --profile-dir (default:
--tensorboard-dir when set, as in Megatron, else ./profile); on a GPU it holds the CUDA kernels too.
"""

from __future__ import annotations

import os

import torch

from megatron_lite.config.sections import Config


def profile_dir(config: Config) -> str:
    log = config.logging
    return log.profile_dir or log.tensorboard_dir or "profile"


class StepProfiler:
    """The torch profiler of this rank's chosen steps, or nothing; `step()` is called as each step begins.

    A run that resumes after N profiles from its first step on; one that ends before M (--exit-interval, a
    signal, an error) writes the steps it ran when the profiler is closed.
    """

    def __init__(self, config: Config, rank: int, device: torch.device, first_iteration: int):
        log = config.logging
        self.start, self.end = max(log.profile_step_start, first_iteration), log.profile_step_end
        self.path = os.path.join(profile_dir(config), f"rank{rank}.pt.trace.json")
        self.rank = rank
        self.iteration = first_iteration  # the step running now
        self.profiler = None
        if log.profile and rank in log.profile_ranks and self.start < self.end:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # Span k of the profiler runs from its k-th step() to the next: step i of this run is span
            # i - first_iteration + 1, and span 0 (start() to the first step()) holds no training step.
            schedule = torch.profiler.schedule(wait=self.start - first_iteration, warmup=1,
                                               active=self.end - self.start, repeat=1)
            self.profiler = torch.profiler.profile(activities=activities, schedule=schedule,
                                                   on_trace_ready=self._write)

    def _write(self, profiler: torch.profiler.profile) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        profiler.export_chrome_trace(self.path)
        last = min(self.iteration, self.end - 1)
        print(f" rank {self.rank}: profile of iterations {self.start + 1}-{last + 1} written to {self.path}",
              flush=True)

    def __enter__(self) -> StepProfiler:
        if self.profiler is not None:
            self.profiler.start()
        return self

    def step(self, iteration: int) -> None:
        """Step `iteration` (0-based) begins."""
        self.iteration = iteration
        if self.profiler is not None:
            self.profiler.step()

    def __exit__(self, *exc_info) -> None:
        if self.profiler is not None:
            self.profiler.stop()
