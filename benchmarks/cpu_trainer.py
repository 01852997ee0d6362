"""The whole trainer on the CPU: `torchrun pretrain_gpt.py` against a transformers training loop.

What a user runs, end to end: `torchrun --nproc-per-node 1 pretrain_gpt.py` (mock data, its data loader,
schedule, gradient buffers, clipping, AdamW, logging) on a small Llama (4 layers, hidden 256, ffn 688,
8 heads / 4 groups, seq 256, micro-batch 4, vocab 8000, fp32), against `LlamaForCausalLM` of the same shape
trained by a plain loop (forward with labels, backward, clip to 1.0, AdamW) on the same number of threads.
Each side runs in its own process, in turn, for --rounds rounds, so a change in the machine's load hits
both alike; tokens/s is the median over the iterations after the warm-up of every round. Prints the figures
and appends them, with the machine's load, to benchmarks/results/cpu_trainer.jsonl.

    python -m benchmarks.cpu_trainer [--iters 30] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.results_file import record_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688, "num_attention_heads": 8,
         "num_query_groups": 4, "seq_length": 256, "max_position_embeddings": 256, "vocab_size": 8000}
MICRO_BATCH = 4
WARMUP = 3


def our_flags(iters: int, metrics: str) -> list[str]:
    flags = ["--model-preset", "llama-tiny", "--mock-data", "--micro-batch-size", str(MICRO_BATCH),
             "--global-batch-size", str(MICRO_BATCH), "--train-iters", str(iters), "--lr", "3e-4",
             "--log-interval", str(iters), "--metrics-jsonl", metrics]
    for name, value in SHAPE.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def run_ours(iters: int, threads: int) -> list[float]:
    """tokens/s of each timed iteration of `torchrun --nproc-per-node 1 pretrain_gpt.py`."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "pretrain_gpt.py",
                   *our_flags(iters, metrics)]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        with open(metrics) as f:
            records = [json.loads(line) for line in f]
    return [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][WARMUP:]


def run_peer(iters: int, threads: int) -> list[float]:
    command = [sys.executable, "-m", "benchmarks.cpu_trainer", "--peer-only", "--iters", str(iters)]
    result = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return json.loads(result.stdout.splitlines()[-1])


def transformers_loop(iters: int) -> list[float]:
    """tokens/s of each timed iteration of a plain LlamaForCausalLM training loop in this process."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=SHAPE["vocab_size"], hidden_size=SHAPE["hidden_size"], intermediate_size=SHAPE["ffn_hidden_size"],
        num_hidden_layers=SHAPE["num_layers"], num_attention_heads=SHAPE["num_attention_heads"],
        num_key_value_heads=SHAPE["num_query_groups"], max_position_embeddings=SHAPE["seq_length"],
        tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01)
    tokens = MICRO_BATCH * SHAPE["seq_length"]
    rates = []
    for _ in range(iters):
        start = time.perf_counter()
        ids = torch.randint(0, SHAPE["vocab_size"], (MICRO_BATCH, SHAPE["seq_length"]))
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rates.append(tokens / (time.perf_counter() - start))
    return rates[WARMUP:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_only:
        print(json.dumps(transformers_loop(args.iters)))
        return
    ours, peer, loads = [], [], []
    for round_ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        ours += run_ours(args.iters, args.threads)
        peer += run_peer(args.iters, args.threads)
        print(f"round {round_ + 1}: megatron_lite {statistics.median(ours):,.0f} tokens/s, "
              f"transformers {statistics.median(peer):,.0f} tokens/s", flush=True)
    figures = {"shape": SHAPE, "micro_batch_size": MICRO_BATCH, "threads": args.threads,
               "tokens_per_sec": {"megatron_lite": statistics.median(ours), "transformers": statistics.median(peer)},
               "load_average_1min": loads}
    figures["ratio"] = figures["tokens_per_sec"]["megatron_lite"] / figures["tokens_per_sec"]["transformers"]
    print(json.dumps(figures))
    record_result("cpu_trainer", figures, sys.argv)


if __name__ == "__main__":
    main()
