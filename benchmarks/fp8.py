"""FP8 against bf16 on the CPU: final training and validation losses of the same run, FP8 recipe by recipe.

Trains the demo model (llama-tiny, examples/demo_cpu.sh) in one process with --bf16, then with --bf16 and
--fp8-format hybrid under each built --fp8-recipe, all from the same initial weights (--seed) on the same
batches, and reports each run's final training loss (the mean of the last 10 iterations), its validation loss
after the last iteration and their relative distance from bf16's (the issue's bound: 1%). On the demo corpus
(data/shakespeare_text_document, data/README.md) when it has been built, else on --mock-data, which says so.
The CPU measures numerics only: it computes the FP8 GEMMs as exact fp32 matmuls, so no speed is reported. Appends
the figures with date, machine and command to benchmarks/results/fp8.jsonl.

    python -m benchmarks.fp8 [--iters 300] [--micro-batch-size 4] [--global-batch-size 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from benchmarks.demo_runs import data_flags, demo_values, train
from benchmarks.results_file import record_result

RUNS = {"bf16": {}, "fp8 tensorwise": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise"},
        "fp8 rowwise": {"fp8_format": "hybrid", "fp8_recipe": "rowwise"}}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    args = parser.parse_args(argv[1:])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    data, source = data_flags()
    common = {**demo_values(args.iters, args.micro_batch_size, args.global_batch_size, data),
              "lr": 3e-3, "min_lr": 3e-4, "eval_iters": 5, "log_interval": 10}
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, extra in RUNS.items():
            results[name] = train({**common, **extra}, os.path.join(scratch, f"{len(results)}.jsonl"))
            print(name, results[name], flush=True)
    bf16 = results["bf16"]
    for run in results.values():
        for key in ("final_train_loss", "final_valid_loss"):
            run[f"{key}_rel_vs_bf16"] = (run[key] - bf16[key]) / bf16[key]
        run["within_1_percent"] = all(abs(run[f"{k}_rel_vs_bf16"]) <= 0.01
                                      for k in ("final_train_loss", "final_valid_loss"))
    record_result("fp8", {"data": source, "iterations": args.iters, "fp8_format": "hybrid",
                          "shape": {k: v for k, v in common.items() if k in ("model_preset", "seq_length",
                                                                             "micro_batch_size",
                                                                             "global_batch_size")},
                          "runs": results}, argv)


if __name__ == "__main__":
    main(sys.argv)
