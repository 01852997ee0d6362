"""Optimizer state held on the device and on the host per rank with --optimizer-cpu-offload, and the step time.

Spawns a gloo world of --ranks CPU processes (pure data parallelism) and trains the same bf16 Llama with the
plain and the distributed optimizer (ZeRO-1), each without offload and with --optimizer-offload-fraction 0.5
and 1.0: a warm-up step, then --steps timed ones, interleaved across the runs (the median counts). Per run
and rank it reports the optimizer bytes left on the device (fp32 masters, Adam moments), those held on the
host (masters, moments, the gradients' arrival buffer, the bf16 weights' outgoing buffer), the device bytes
saved against the same optimizer without offload, the planner's prediction of the device and host optimizer
bytes (planning/state_memory.py), and the step time as a ratio to no offload. On a CPU-only machine the
"device" is the CPU too: the byte counts are those a GPU run holds, the time is the cost of the extra copies
and of stepping on one CPU core, not of a PCIe transfer. Appends the figures with date, machine and command to
benchmarks/results/optimizer_offload.jsonl.

    python -m benchmarks.optimizer_offload [--ranks 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.results_file import record_result
from benchmarks.timed_runs import SHAPE, TimedRun, time_runs
from megatron_lite.planning.state_memory import stage_state_bytes

STRATEGIES = ("no_shard", "optim")
FRACTIONS = (None, 0.5, 1.0)  # None: no offload


def optimizer_bytes(run: TimedRun) -> dict:
    """The optimizer bytes this rank holds on the device and on the host, the planner's prediction of both,
    its parameter count, step time and loss."""
    o = run.config.optimizer
    fraction = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    planned = stage_state_bytes(run.config, run.pstate.pp_rank, run.pstate.dp_rank, fraction)
    return {"device": run.optimizer.memory_footprint(), "host": run.optimizer.host_memory_footprint(),
            "planned_device": planned.optimizer, "planned_host": planned.optimizer_on_host,
            "numel": run.local_numel(), "seconds_per_step": run.median_seconds(), "loss": run.loss}


def summarize(figures: dict) -> dict:
    """Per run, the largest rank's bytes (they differ by bucket padding only), savings and time ratios."""
    rows = {}
    for (strategy, fraction), ranks in figures.items():
        largest = max(ranks, key=lambda r: sum(r["device"].values()) + sum(r["host"].values()))
        plain = max(figures[(strategy, None)], key=lambda r: sum(r["device"].values()))
        device, host = sum(largest["device"].values()), sum(largest["host"].values())
        rows[f"{strategy} offload={fraction or 0:g}"] = {
            "strategy": strategy, "offload_fraction": fraction or 0.0, "params_per_rank": largest["numel"],
            "device_optimizer_bytes": largest["device"], "host_optimizer_bytes": largest["host"],
            "device_total": device, "host_total": host,
            "device_bytes_saved": sum(plain["device"].values()) - device,
            "planned_device_optimizer_bytes": largest["planned_device"],
            "planned_host_optimizer_bytes": largest["planned_host"],
            "seconds_per_step": max(r["seconds_per_step"] for r in ranks), "loss": ranks[0]["loss"],
            "time_ratio_vs_no_offload": (max(r["seconds_per_step"] for r in ranks)
                                         / max(r["seconds_per_step"] for r in figures[(strategy, None)]))}
    return rows


def print_table(rows: dict) -> None:
    mib = 2.0**20
    print("optimizer state held by one rank between steps, MiB (bf16 weights; planner's prediction in brackets)")
    print(f"{'run':<24}{'device':>18}{'host':>18}{'of which buffers':>18}{'saved':>9}{'s/step':>9}{'vs plain':>10}")
    for name, row in rows.items():
        buffers = row["host_optimizer_bytes"]["grads"] + row["host_optimizer_bytes"]["outgoing"]
        print(f"{name:<24}{row['device_total'] / mib:>8.2f} ({row['planned_device_optimizer_bytes'] / mib:>6.2f})"
              f"{row['host_total'] / mib:>8.2f} ({row['planned_host_optimizer_bytes'] / mib:>6.2f})"
              f"{buffers / mib:>18.2f}{row['device_bytes_saved'] / mib:>9.2f}{row['seconds_per_step']:>9.3f}"
              f"{row['time_ratio_vs_no_offload']:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    runs = {(strategy, fraction): {"data_parallel_sharding_strategy": strategy,
                                   **({} if fraction is None else {"optimizer_cpu_offload": True,
                                                                   "optimizer_offload_fraction": fraction})}
            for strategy in STRATEGIES for fraction in FRACTIONS}
    figures = time_runs(runs, args.ranks, args.steps, optimizer_bytes)
    rows = summarize(figures)
    print_table(rows)
    record_result("optimizer_offload", {"config": SHAPE, "ranks": args.ranks, "steps": args.steps,
                                        "load_average": os.getloadavg(), "runs": rows}, sys.argv)


if __name__ == "__main__":
    main()
