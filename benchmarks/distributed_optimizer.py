"""Per-rank memory and step time of each ZeRO stage, against no_shard in the same run and against theory.

Spawns a gloo world of --ranks CPU processes (pure data parallelism, d = --ranks) and trains the same bf16
Llama with each --data-parallel-sharding-strategy, one step of each in turn (a warm-up step, then --steps
timed ones; the median counts).
Per strategy it reports the bytes per parameter a rank holds between steps in weights, gradients, fp32
masters and Adam moments (the largest rank; they differ by bucket padding only), the theory for the
layout (bf16 weights: 18 unsharded, 6 + 12/d ZeRO-1, 2 + 16/d ZeRO-2, 18/d ZeRO-3), and the step time,
each as a ratio to no_shard. Appends the figures with date, machine and command to
benchmarks/results/distributed_optimizer.jsonl.

    python -m benchmarks.distributed_optimizer [--ranks 4] [--steps 4] [--overlap]
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.results_file import record_result
from benchmarks.timed_runs import SHAPE, TimedRun, time_runs

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
CATEGORIES = ("params", "grads", "master", "moments")


def theory_bytes_per_param(strategy: str, d: int) -> dict[str, float]:
    """bf16 weights, fp32 gradients, fp32 masters, two fp32 moments; what each ZeRO stage divides by d."""
    stage = STRATEGIES.index(strategy)
    return {"params": 2 / (d if stage >= 3 else 1), "grads": 4 / (d if stage >= 2 else 1),
            "master": 4 / (d if stage >= 1 else 1), "moments": 8 / (d if stage >= 1 else 1)}


def held_bytes(run: TimedRun) -> dict:
    """The bytes this rank holds between steps by category, its parameter count, step time and loss."""
    held = run.optimizer.memory_footprint()
    for chunk in run.model:
        held.update(chunk.memory_footprint())
    return {"bytes": held, "numel": run.local_numel(), "seconds_per_step": run.median_seconds(), "loss": run.loss}


def summarize(figures: dict, d: int) -> dict:
    """Largest rank's bytes per parameter by category, theory, total and ratios to no_shard."""
    rows = {}
    for strategy, ranks in figures.items():
        numel = ranks[0]["numel"]
        measured = {k: max(r["bytes"][k] for r in ranks) / numel for k in CATEGORIES}
        theory = theory_bytes_per_param(strategy, d)
        rows[strategy] = {"measured_bytes_per_param": measured, "theory_bytes_per_param": theory,
                          "total": sum(measured.values()), "theory_total": sum(theory.values()),
                          "seconds_per_step": max(r["seconds_per_step"] for r in ranks), "loss": ranks[0]["loss"],
                          "params_per_rank": numel}
    base = rows["no_shard"]
    for row in rows.values():
        row["memory_ratio_vs_no_shard"] = row["total"] / base["total"]
        row["time_ratio_vs_no_shard"] = row["seconds_per_step"] / base["seconds_per_step"]
    return rows


def print_table(rows: dict, d: int) -> None:
    print(f"bytes per parameter held by one rank between steps (bf16 weights, d = {d}); measured (theory)")
    print(f"{'strategy':<20}" + "".join(f"{c:>16}" for c in CATEGORIES)
          + f"{'total':>16}{'vs no_shard':>12}{'s/step':>9}{'vs no_shard':>12}")
    for strategy, row in rows.items():
        cells = "".join(f"{row['measured_bytes_per_param'][c]:>7.2f} ({row['theory_bytes_per_param'][c]:>5.2f})"
                        for c in CATEGORIES)
        print(f"{strategy:<20}{cells}{row['total']:>7.2f} ({row['theory_total']:>5.2f})"
              f"{row['memory_ratio_vs_no_shard']:>12.3f}{row['seconds_per_step']:>9.3f}"
              f"{row['time_ratio_vs_no_shard']:>12.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--overlap", action="store_true", help="--overlap-grad-reduce and --overlap-param-gather")
    args = parser.parse_args()
    runs = {strategy: {"data_parallel_sharding_strategy": strategy, "overlap_grad_reduce": args.overlap,
                       "overlap_param_gather": args.overlap and strategy != "no_shard"} for strategy in STRATEGIES}
    figures = time_runs(runs, args.ranks, args.steps, held_bytes)
    rows = summarize(figures, args.ranks)
    print_table(rows, args.ranks)
    record_result("distributed_optimizer", {"config": SHAPE, "ranks": args.ranks, "steps": args.steps,
                                            "overlap": args.overlap, "load_average": os.getloadavg(),
                                            "strategies": rows}, sys.argv)


if __name__ == "__main__":
    main()
