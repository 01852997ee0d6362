"""Muon against AdamW on the demo model: validation loss at the best of three learning rates each, and the
step-time overhead of Newton-Schulz at DP2 with the distributed optimizer.

Loss: the demo model (llama-tiny, examples/demo_cpu.sh) in one process, bf16, the same initial weights
(--seed) and batches for every run, trained --iters iterations with AdamW at each of --lrs and with --optimizer
muon at each of --muon-lrs (cosine decay to a tenth, warmup 1/15 of the run, weight decay 0.1). Muon runs with
--muon-extra-scale-factor 0.2 on the spectral scale, Moonlight's choice, whose update RMS (0.2) is AdamW's, so
that both take the same learning-rate grid; AdamW steps the embeddings, output layer and norms of both. Each
run's validation loss after the last iteration is reported; the best of each optimizer is compared. On the
demo corpus (data/shakespeare_text_document, data/README.md) when it is built, else on --mock-data, which
says so.

Step time: two CPU processes (gloo), the small Llama of benchmarks/timed_runs.py, ZeRO-1, AdamW against Muon
(each matrix orthogonalised at its owner rank), the median of --timed-steps steps, taken in turn so that load
changes hit both alike. Appends the figures with date, machine and command to benchmarks/results/muon.jsonl.

    python -m benchmarks.muon [--iters 600] [--lrs 1e-3 3e-3 1e-2] [--muon-lrs ...] [--timed-steps 20]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from benchmarks.demo_runs import data_flags, demo_values, train
from benchmarks.results_file import record_result
from benchmarks.timed_runs import time_runs

OPTIMIZERS = {"adamw": {}, "muon": {"optimizer": "muon", "muon_extra_scale_factor": 0.2}}


def step_seconds(run) -> float:
    return run.median_seconds()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=600)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon-lrs", type=float, nargs="+", help="Muon's learning rates; default: --lrs")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--timed-steps", type=int, default=20)
    args = parser.parse_args(argv[1:])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    data, source = data_flags()
    common = {**demo_values(args.iters, args.micro_batch_size, args.global_batch_size, data),
              "eval_iters": 10, "log_interval": 50}
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, extra in OPTIMIZERS.items():
            for lr in (args.muon_lrs or args.lrs) if name == "muon" else args.lrs:
                values = {**common, **extra, "lr": lr, "min_lr": lr / 10}
                runs[f"{name} lr {lr:g}"] = {"optimizer": name, "lr": lr,
                                             **train(values, os.path.join(scratch, f"{len(runs)}.jsonl"))}
                print(f"{name} lr {lr:g}", runs[f"{name} lr {lr:g}"], flush=True)
    best = {name: min((r for r in runs.values() if r["optimizer"] == name), key=lambda r: r["final_valid_loss"])
            for name in OPTIMIZERS}
    timed = time_runs({name: {"use_distributed_optimizer": True, **extra} for name, extra in OPTIMIZERS.items()},
                      2, args.timed_steps, step_seconds)
    seconds = {name: max(per_rank) for name, per_rank in timed.items()}
    figures = {"data": source, "iterations": args.iters, "tokens_per_run": args.iters * args.global_batch_size * 128,
               "shape": {k: v for k, v in common.items() if k in ("model_preset", "seq_length", "micro_batch_size",
                                                                  "global_batch_size", "weight_decay")},
               "runs": runs,
               "best": {name: {"lr": r["lr"], "final_valid_loss": r["final_valid_loss"]} for name, r in best.items()},
               "muon_valid_loss_minus_adamw": best["muon"]["final_valid_loss"] - best["adamw"]["final_valid_loss"],
               "dp2_zero1_step_seconds": seconds,
               "dp2_zero1_muon_step_overhead": seconds["muon"] / seconds["adamw"] - 1.0}
    print({k: figures[k] for k in ("best", "muon_valid_loss_minus_adamw", "dp2_zero1_step_seconds",
                                   "dp2_zero1_muon_step_overhead")}, flush=True)
    record_result("muon", figures, argv)


if __name__ == "__main__":
    main(sys.argv)
