"""One GPU: FP8 training (--fp8-format hybrid, each built --fp8-recipe) against bf16 through `pretrain()`.

In one run, on one device, every model from the same initial weights (--seed) on the same mock batches:
  1. a stack of four Llama-3-8B layers (hidden 4096, ffn 14336, 32 heads / 8 groups, vocab 128256, seq 8192,
     micro-batch 1): tokens/s, TFLOP/s and peak memory of bf16 and of FP8 per recipe (the target: >= 1.25x);
  2. the Llama-3.2-1B shape (benchmarks/gpu_step.py's) for --iters iterations (50 by default): tokens/s (the
     target: >= 1.1x), and the final training loss (the mean of the last 5 iterations) within 1% of bf16's.
Eager only: fp8.py's linears run eagerly under --torch-compile (their amax reductions are collectives), so a
compiled FP8 run measures graph breaks, not FP8. TFLOP/s and MFU are counted against the model's FLOPs, MFU over
the device's dense bf16 peak, as the training log line does. Figures are medians over the iterations after the
warm-up, appended with date, device and command to fp8_gpu.jsonl in the results folder (benchmarks/results/, or
$BENCHMARK_RESULTS_DIR); `--tiny` runs every part on a tiny model on the CPU (the test suite does) and only prints.

    BENCHMARK_RESULTS_DIR=$OUT python -m benchmarks.fp8_gpu   # one H200: about 3 minutes
    python -m benchmarks.fp8_gpu --tiny                       # CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import pretrain_gpt
from benchmarks.gpu_step import LLAMA_1B, TINY, measured, run_config
from benchmarks.results_file import record_result
from megatron_lite.training.loop import pretrain

LLAMA3_8B_LAYERS = {"num_layers": 4, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
                    "num_query_groups": 8, "vocab_size": 128256, "seq_length": 8192, "max_position_embeddings": 8192,
                    "rotary_base": 500000.0, "untie_embeddings_and_output_weights": True}
PRECISIONS = {"bf16": {}, "fp8 tensorwise": {"fp8_format": "hybrid", "fp8_recipe": "tensorwise"},
              "fp8 rowwise": {"fp8_format": "hybrid", "fp8_recipe": "rowwise"}}
SPEED_TARGETS = {"llama3_8b_4_layers": 1.25, "llama3.2_1b": 1.1}


def timed(shape: dict, device: torch.device, precision: dict, *, micro_batch: int, microbatches: int, iters: int,
          warmup: int, bf16: bool) -> dict:
    """tokens/s, TFLOP/s, MFU, peak memory and the final loss of one `pretrain()` run."""
    config = run_config(shape, device, bf16=bf16, micro_batch=micro_batch, microbatches=microbatches, iters=iters,
                        log_interval=1, **precision)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    figures = {key: measured(records, warmup, key) for key in ("tokens_per_sec", "tflops_per_device",
                                                               "iteration_time_s")}
    if "mfu" in records[-1]:
        figures["mfu"] = measured(records, warmup, "mfu")
    figures["peak_memory_gib"] = max(r["memory_gib"] for r in records)
    figures["final_loss"] = statistics.mean(r["lm_loss"] for r in records[-5:])
    figures["losses"] = [r["lm_loss"] for r in records]
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, every part, print only")
    parser.add_argument("--iters", type=int, default=50, help="iterations of the 1B runs (the loss comparison)")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    cases = {  # name: (shape, micro-batch, micro-batches, iterations, warm-up)
        "llama3_8b_4_layers": (TINY if args.tiny else LLAMA3_8B_LAYERS, 1, 2, 4 if args.tiny else 8, 2),
        "llama3.2_1b": (TINY if args.tiny else LLAMA_1B, 2, 4, 8 if args.tiny else args.iters, 3),
    }
    started = time.perf_counter()
    figures = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for case, (shape, micro_batch, microbatches, iters, warmup) in cases.items():
        runs = {name: timed(shape, device, precision, micro_batch=micro_batch, microbatches=microbatches,
                            iters=iters, warmup=warmup, bf16=True) for name, precision in PRECISIONS.items()}
        bf16 = runs["bf16"]
        for name, run in runs.items():
            if name != "bf16":
                run["speedup_vs_bf16"] = run["tokens_per_sec"] / bf16["tokens_per_sec"]
                run["meets_speed_target"] = run["speedup_vs_bf16"] >= SPEED_TARGETS[case]
                run["final_loss_vs_bf16"] = run["final_loss"] / bf16["final_loss"] - 1.0
        figures[case] = {"shape": shape, "micro_batch_size": micro_batch, "microbatches": microbatches,
                         "iters": iters, "runs": runs}
    figures["seconds"] = time.perf_counter() - started
    print(json.dumps(figures, indent=1))
    if not args.tiny:
        record_result("fp8_gpu", figures, [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    return figures


if __name__ == "__main__":
    main()
