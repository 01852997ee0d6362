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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.config import make_config
from megatron_lite.optim.distributed_optimizer import build_optimizer
from megatron_lite.planning.state_memory import stage_state_bytes
from megatron_lite.training import build_data_iterator, build_datasets, build_model, initialize, train_step

SHAPE = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 344,
         "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 4096, "seq_length": 128,
         "max_position_embeddings": 128, "micro_batch_size": 2, "bf16": True, "lr": 1e-3, "eval_interval": 10_000,
         "log_interval": 10_000}
STRATEGIES = ("no_shard", "optim")
FRACTIONS = (None, 0.5, 1.0)  # None: no offload


class Run:
    """One configuration's model, optimizer and data on this rank."""

    def __init__(self, strategy: str, fraction: float | None, world_size: int, steps: int):
        offload = {} if fraction is None else {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction}
        self.config = make_config({**SHAPE, **offload, "global_batch_size": 4 * world_size, "train_iters": steps + 1,
                                   "data_parallel_sharding_strategy": strategy}, world_size)
        self.fraction = fraction or 0.0
        self.pstate, self.device = initialize(self.config)
        self.model = build_model(self.config, self.pstate, pretrain_gpt.model_provider, self.device)
        self.optimizer = build_optimizer(self.config, self.model, self.pstate)
        self.iterator = build_data_iterator(build_datasets(self.config)[0], self.config, self.pstate, 0)
        self.iteration, self.seconds, self.loss = 0, [], None

    def step(self) -> None:
        dist.barrier()
        start = time.perf_counter()
        metrics = train_step(pretrain_gpt.forward_step, self.iterator, self.model, self.optimizer, self.config,
                             self.pstate, self.iteration, self.device)
        dist.barrier()
        self.seconds.append(time.perf_counter() - start)
        self.iteration, self.loss = self.iteration + 1, metrics["lm_loss"]

    def figures(self) -> dict:
        planned = stage_state_bytes(self.config, self.pstate.pp_rank, self.pstate.dp_rank, self.fraction)
        timed = sorted(self.seconds[1:])  # the first step warms up
        return {"device": self.optimizer.memory_footprint(), "host": self.optimizer.host_memory_footprint(),
                "planned_device": planned.optimizer, "planned_host": planned.optimizer_on_host,
                "numel": sum(p.numel() for chunk in self.model for p in chunk.module.parameters()),
                "seconds_per_step": timed[len(timed) // 2], "loss": self.loss}


def _worker(rank: int, world_size: int, init_file: str, args, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    runs = {(s, f): Run(s, f, world_size, args.steps) for s in STRATEGIES for f in FRACTIONS}
    for _ in range(args.steps + 1):  # interleaved, so that a change of machine load hits every run
        for run in runs.values():
            run.step()
    figures = {}
    for key, run in runs.items():
        everyone = [None] * world_size
        dist.all_gather_object(everyone, run.figures())
        figures[key] = everyone
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


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
    print(f"{'run':<24}{'device':>18}{'host':>18}{'saved':>9}{'host buffers':>14}{'s/step':>9}{'vs plain':>10}")
    for name, row in rows.items():
        buffers = row["host_optimizer_bytes"]["grads"] + row["host_optimizer_bytes"]["outgoing"]
        state = row["host_total"] - buffers
        print(f"{name:<24}{row['device_total'] / mib:>8.2f} ({row['planned_device_optimizer_bytes'] / mib:>6.2f})"
              f"{state / mib:>8.2f} ({row['planned_host_optimizer_bytes'] / mib:>6.2f})"
              f"{row['device_bytes_saved'] / mib:>9.2f}{buffers / mib:>14.2f}{row['seconds_per_step']:>9.3f}"
              f"{row['time_ratio_vs_no_offload']:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        workers = mp.start_processes(_worker, args=(args.ranks, os.path.join(tmp, "init"), args, results),
                                     nprocs=args.ranks, start_method="spawn", join=False)
        figures = results.get()
        while not workers.join():
            pass
    rows = summarize(figures)
    print_table(rows)
    record_result("optimizer_offload", {"config": SHAPE, "ranks": args.ranks, "steps": args.steps,
                                        "load_average": os.getloadavg(), "runs": rows}, sys.argv)


if __name__ == "__main__":
    main()
