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
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.config import make_config
from megatron_lite.optim.distributed_optimizer import build_optimizer
from megatron_lite.training import build_data_iterator, build_datasets, build_model, initialize, train_step

SHAPE = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 344,
         "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 4096, "seq_length": 128,
         "max_position_embeddings": 128, "micro_batch_size": 2, "bf16": True, "lr": 1e-3, "eval_interval": 10_000,
         "log_interval": 10_000}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
CATEGORIES = ("params", "grads", "master", "moments")


def theory_bytes_per_param(strategy: str, d: int) -> dict[str, float]:
    """bf16 weights, fp32 gradients, fp32 masters, two fp32 moments; what each ZeRO stage divides by d."""
    stage = STRATEGIES.index(strategy)
    return {"params": 2 / (d if stage >= 3 else 1), "grads": 4 / (d if stage >= 2 else 1),
            "master": 4 / (d if stage >= 1 else 1), "moments": 8 / (d if stage >= 1 else 1)}


class Run:
    """One strategy's model, optimizer and data on this rank."""

    def __init__(self, strategy: str, world_size: int, steps: int, overlap: bool):
        flags = {"overlap_grad_reduce": overlap, "overlap_param_gather": overlap and strategy != "no_shard"}
        self.config = make_config({**SHAPE, **flags, "global_batch_size": 4 * world_size, "train_iters": steps + 1,
                                   "data_parallel_sharding_strategy": strategy}, world_size)
        self.pstate, self.device = initialize(self.config)
        self.model = build_model(self.config, self.pstate, pretrain_gpt.model_provider, self.device)
        self.optimizer = build_optimizer(self.config, self.model, self.pstate)
        self.iterator = build_data_iterator(build_datasets(self.config)[0], self.config, self.pstate, 0)
        self.forward_step = pretrain_gpt.forward_step
        self.iteration, self.seconds, self.loss = 0, [], None

    def step(self) -> None:
        dist.barrier()
        start = time.perf_counter()
        metrics = train_step(self.forward_step, self.iterator, self.model, self.optimizer, self.config, self.pstate,
                             self.iteration, self.device)
        dist.barrier()
        self.seconds.append(time.perf_counter() - start)
        self.iteration, self.loss = self.iteration + 1, metrics["lm_loss"]

    def figures(self) -> dict:
        held = self.optimizer.memory_footprint()
        for chunk in self.model:
            held.update(chunk.memory_footprint())
        numel = sum(p.numel() for chunk in self.model for p in chunk.module.parameters())
        timed = sorted(self.seconds[1:])  # the first step warms up
        return {"bytes": held, "numel": numel, "seconds_per_step": timed[len(timed) // 2], "loss": self.loss}


def _worker(rank: int, world_size: int, init_file: str, args, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    runs = {strategy: Run(strategy, world_size, args.steps, args.overlap) for strategy in STRATEGIES}
    for _ in range(args.steps + 1):  # interleaved, so that a change of machine load hits every strategy
        for run in runs.values():
            run.step()
    figures = {}
    for strategy, run in runs.items():
        everyone = [None] * world_size
        dist.all_gather_object(everyone, run.figures())
        figures[strategy] = everyone
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


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
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        workers = mp.start_processes(_worker, args=(args.ranks, os.path.join(tmp, "init"), args, results),
                                     nprocs=args.ranks, start_method="spawn", join=False)
        figures = results.get()
        while not workers.join():
            pass
    rows = summarize(figures, args.ranks)
    print_table(rows, args.ranks)
    record_result("distributed_optimizer", {"config": SHAPE, "ranks": args.ranks, "steps": args.steps,
                                            "overlap": args.overlap, "load_average": os.getloadavg(),
                                            "strategies": rows}, sys.argv)


if __name__ == "__main__":
    main()
