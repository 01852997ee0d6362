"""FP8 against bf16 on the CPU: final training and validation losses of the same run, FP8 recipe by recipe.

Trains the demo model (llama-tiny, examples/demo_cpu.sh) in one process with --bf16, then with --bf16 and
--fp8-format hybrid under each built --fp8-recipe, all from the same initial weights (--seed) on the same
batches, and reports each run's final training loss (the mean of the last 10 iterations), its validation loss
after the last iteration and their relative distance from bf16's (the issue's bound: 1%). On the demo corpus
(data/shakespeare_text_document, data/README.md) when it has been built, else on --mock-data, which says so.
The CPU measures numerics only: _scaled_mm on the CPU is a reference kernel, so no speed is reported. Appends
the figures with date, machine and command to benchmarks/results/fp8.jsonl.

    python -m benchmarks.fp8 [--iters 300] [--micro-batch-size 4] [--global-batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.arguments import make_config
from megatron_lite.training import pretrain

CORPUS = "data/shakespeare_text_document"
TOKENIZER = "data/tokenizer.model"
RUNS = {"bf16": {}, "fp8 tensorwise": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise"},
        "fp8 rowwise": {"fp8_format": "hybrid", "fp8_recipe": "rowwise"}}


def data_flags() -> tuple[dict, str]:
    """The demo corpus's flags when it is built, else mock data's; and which one."""
    if os.path.exists(CORPUS + ".idx") and os.path.exists(TOKENIZER):
        return {"data_path": [CORPUS], "split": "969,30,1", "tokenizer_type": "SentencePieceTokenizer",
                "tokenizer_model": TOKENIZER}, "demo corpus (Shakespeare)"
    return {"mock_data": True, "vocab_size": 4000}, "mock data (the demo corpus is not built here)"


def train(values: dict, metrics_path: str) -> dict:
    """Final training loss (mean of the last 10 iterations) and the validation loss after the last one."""
    history = pretrain(make_config({**values, "metrics_jsonl": metrics_path}, 1), pretrain_gpt.model_provider,
                       pretrain_gpt.forward_step)
    with open(metrics_path) as f:
        valid = [r["valid_lm_loss"] for r in map(json.loads, f) if "valid_lm_loss" in r]
    losses = [h["lm_loss"] for h in history]
    return {"final_train_loss": sum(losses[-10:]) / len(losses[-10:]), "final_valid_loss": valid[-1],
            "first_train_loss": losses[0]}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    args = parser.parse_args(argv[1:])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    data, source = data_flags()
    common = {"model_preset": "llama-tiny", "device": "cpu", "bf16": True, "seq_length": 128,
              "micro_batch_size": args.micro_batch_size, "global_batch_size": args.global_batch_size,
              "train_iters": args.iters, "lr": 3e-3, "min_lr": 3e-4, "lr_warmup_iters": max(args.iters // 15, 1),
              "weight_decay": 0.1, "eval_interval": args.iters, "eval_iters": 5, "log_interval": 10, "seed": 1234,
              **data}
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
