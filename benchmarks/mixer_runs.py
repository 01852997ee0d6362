"""What the token-mixer benchmarks (gated_delta_net.py, mamba2.py) share: a core of ours against transformers'
torch reference of it, forward and backward in turn, and a whole pretrain() of the llama-tiny shape on mock data."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable


def time_in_turn(functions: dict[str, Callable], inputs: dict, repeats: int) -> dict:
    """`functions` {"megatron_lite": ..., "transformers": ...} of the same keyword inputs: their outputs' largest
    difference relative to transformers', and the median of `repeats` forward + backward times of each (taken in
    turn after a warm-up round)."""
    import torch

    with torch.no_grad():
        ours, theirs = (function(**inputs) for function in functions.values())
    difference = float((ours - theirs).abs().max() / theirs.abs().max())
    seconds = {name: [] for name in functions}
    for _ in range(repeats + 1):
        for name, function in functions.items():
            start = time.perf_counter()
            function(**inputs).sum().backward()
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(times[1:]) for name, times in seconds.items()}
    return {"max_relative_difference": difference, "forward_backward_s": medians,
            "ours_over_transformers": medians["megatron_lite"] / medians["transformers"]}


def train(values: dict, iters: int, seq_length: int) -> dict:
    """pretrain() of the llama-tiny shape with `values` on top: the median tokens/s of the records after the first,
    and the final loss."""
    import pretrain_gpt
    from megatron_lite.config.arguments import make_config
    from megatron_lite.training.loop import pretrain

    with tempfile.TemporaryDirectory() as scratch:
        metrics = os.path.join(scratch, "metrics.jsonl")
        history = pretrain(make_config({"model_preset": "llama-tiny", "mock_data": True, "vocab_size": 4000,
                                        "seq_length": seq_length, "max_position_embeddings": seq_length,
                                        "micro_batch_size": 2, "global_batch_size": 4, "train_iters": iters,
                                        "lr": 1e-3, "eval_interval": 10_000, "log_interval": 1,
                                        "metrics_jsonl": metrics, "seed": 1234, **values}, 1),
                           pretrain_gpt.model_provider, pretrain_gpt.forward_step)
        with open(metrics) as f:
            rates = [r["tokens_per_sec"] for r in map(json.loads, f) if "tokens_per_sec" in r]
    return {"tokens_per_sec": statistics.median(rates[1:]), "final_loss": history[-1]["lm_loss"]}


def compare(argv: list[str], description: str, name: str, core: str, time_core: Callable, hybrid: dict,
            softmax: dict) -> None:
    """The command line both benchmarks take (--seq-length, --heads, --repeats, --iters): `time_core(seq_length,
    heads, repeats)` recorded under `core`, then training runs of the `hybrid` and `softmax` values; the figures
    appended to benchmarks/results/<name>.jsonl."""
    import argparse

    import torch

    from benchmarks.results_file import record_result

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=12)
    args = parser.parse_args(argv[1:])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    timed = time_core(args.seq_length, args.heads, args.repeats)
    print(core, timed, flush=True)
    runs = {label: train(values, args.iters, args.seq_length) for label, values in (("hybrid", hybrid),
                                                                                  ("softmax", softmax))}
    print("training", runs, flush=True)
    record_result(name, {"seq_length": args.seq_length, "heads": args.heads, core: timed, "training": runs,
                         "hybrid_over_softmax_tokens_per_sec":
                             runs["hybrid"]["tokens_per_sec"] / runs["softmax"]["tokens_per_sec"]}, argv)
