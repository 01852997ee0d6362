"""--log-straggler: which ranks hold the job back, from every rank's phase times over each log interval.

A job runs at its slowest rank's pace, and the logging rank's own times show only the waiting that causes.
Every rank sums its phase times (timers.py) over the log interval; at the interval they are gathered to the
logging rank (one gather of four floats per rank, nothing per step), which reports for each phase the min,
median and max over the ranks (with the rank holding the max), and the --straggler-minmax-count slowest
ranks with their hosts and the phase where each exceeds the median most. A rank's own work is its
forward-backward, optimizer and data-wait time; the gradient reduction is mostly waiting for the other
ranks, so it is reported but does not count towards a rank's slowness.
"""

from __future__ import annotations

import socket
import statistics

import torch

from megatron_lite.checkpoint.agreement import all_gather
from megatron_lite.parallel import mappings
from megatron_lite.training.timers import PHASES

OWN_WORK = ("forward_backward", "optimizer", "data_wait")


def straggler_summary(times_ms: list[list[float]], hosts: list[str], count: int) -> dict:
    """The report of one interval: `times_ms[rank][k]` is rank's time in PHASES[k] over the interval."""
    summary = {}
    medians = {}
    for k, phase in enumerate(PHASES):
        column = [row[k] for row in times_ms]
        medians[phase] = statistics.median(column)
        slowest = max(range(len(column)), key=column.__getitem__)
        summary.update({f"straggler_{phase}_ms_min": min(column), f"straggler_{phase}_ms_median": medians[phase],
                        f"straggler_{phase}_ms_max": column[slowest], f"straggler_{phase}_max_rank": slowest})
    own = {rank: sum(row[PHASES.index(phase)] for phase in OWN_WORK) for rank, row in enumerate(times_ms)}
    ranked = sorted(own, key=lambda rank: (-own[rank], rank))[:count]
    stragglers = []
    for rank in ranked:
        row = times_ms[rank]
        phase = max(OWN_WORK, key=lambda p: row[PHASES.index(p)] - medians[p])
        stragglers.append({"rank": rank, "host": hosts[rank], "phase": phase, "ms": row[PHASES.index(phase)],
                           "median_ms": medians[phase]})
    summary["stragglers"] = stragglers
    summary["straggler_slowest_rank"] = ranked[0]
    return summary


def format_stragglers(stragglers: list[dict]) -> str:
    """The console's part: 'slowest rank 3 (node7) forward_backward 61 ms, median 12 ms'."""
    return "slowest " + ", ".join(f"rank {s['rank']} ({s['host']}) {s['phase']} {s['ms']:.0f} ms, median "
                                  f"{s['median_ms']:.0f} ms" for s in stragglers)


class StragglerReport:
    """Sums this rank's phase times between log intervals; `report` gathers them (a collective: every rank of
    `group` calls it at the same iterations) and returns the summary on `logging_rank`, {} elsewhere."""

    def __init__(self, count: int, group, rank: int, logging_rank: int, device: torch.device):
        self.count, self.group, self.rank, self.logging_rank, self.device = count, group, rank, logging_rank, device
        self.hosts = all_gather(socket.gethostname(), group)  # once, at start-up
        self.sums = dict.fromkeys(PHASES, 0.0)

    def add(self, record: dict) -> None:
        for phase in PHASES:
            self.sums[phase] += record.get(f"time_{phase}_ms", 0.0)

    def report(self) -> dict:
        mine = torch.tensor([self.sums[phase] for phase in PHASES], dtype=torch.float64, device=self.device)
        self.sums = dict.fromkeys(PHASES, 0.0)
        if self.group is None:
            return straggler_summary([mine.tolist()], self.hosts, self.count)
        gathered = [torch.empty_like(mine) for _ in self.hosts] if self.rank == self.logging_rank else None
        mappings.gather_to(mine, gathered, self.logging_rank, self.group)
        if gathered is None:
            return {}
        return straggler_summary([row.tolist() for row in gathered], self.hosts, self.count)
