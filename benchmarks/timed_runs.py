"""Training configurations timed side by side in one spawned gloo world of CPU processes.

Each rank builds every configuration's model, optimizer and data at once, then steps them in turn (a warm-up
step, then the timed ones), so that a change of machine load hits every configuration alike; a step's time is
taken between barriers, so it is the slowest rank's. What a benchmark reports of each run comes from a
module-level function of the run (it must reach the spawned ranks by reference), gathered from every rank.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import (
    build_data_iterator,
    build_datasets,
    initialize,
    setup_model_and_optimizer,
    train_step,
)

# A small bf16 Llama that steps in a fraction of a second on one CPU core.
SHAPE = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 344,
         "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 4096, "seq_length": 128,
         "max_position_embeddings": 128, "micro_batch_size": 2, "bf16": True, "lr": 1e-3, "eval_interval": 10_000,
         "log_interval": 10_000}


class TimedRun:
    """One configuration's model, optimizer and data on this rank, and the time of each of its steps."""

    def __init__(self, values: dict, world_size: int, steps: int):
        self.config = make_config({**SHAPE, "global_batch_size": 4 * world_size, "train_iters": steps + 1, **values},
                                  world_size)
        self.pstate, self.device = initialize(self.config)
        self.model, self.optimizer = setup_model_and_optimizer(self.config, self.pstate, pretrain_gpt.model_provider,
                                                               self.device)
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

    def median_seconds(self) -> float:
        """The median time of a step after the first, which warms up."""
        timed = sorted(self.seconds[1:])
        return timed[len(timed) // 2]

    def local_numel(self) -> int:
        return sum(p.numel() for chunk in self.model for p in chunk.module.parameters())


def _rank_main(rank: int, world_size: int, init_file: str, runs: dict, steps: int, report: Callable, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    built = {key: TimedRun(values, world_size, steps) for key, values in runs.items()}
    for _ in range(steps + 1):
        for run in built.values():
            run.step()
    figures = {}
    for key, run in built.items():
        everyone = [None] * world_size
        dist.all_gather_object(everyone, report(run))
        figures[key] = everyone
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def time_runs(runs: dict, world_size: int, steps: int, report: Callable[[TimedRun], dict]) -> dict:
    """Per key of `runs` (flags over SHAPE), the list of every rank's `report(run)` after `steps` timed steps."""
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        workers = mp.start_processes(_rank_main, args=(world_size, os.path.join(tmp, "init"), runs, steps, report,
                                                       results),
                                     nprocs=world_size, start_method="spawn", join=False)
        figures = results.get()
        while not workers.join():
            pass
    return figures
