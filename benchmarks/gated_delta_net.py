"""Gated DeltaNet on the CPU: the chunked delta rule against transformers' own torch implementation of it (the
Qwen3-Next reference, `torch_chunk_gated_delta_rule`), and whole training runs of a hybrid model against the
softmax-only model of the same shape.

The rule: forward and backward of one [b, s, heads, 128] rule in fp32 (q and k L2-normalised, no documents),
ours and transformers' on the same inputs, taken in turn, the median of --repeats; their outputs are compared
first. Training: pretrain() of the demo model's shape (benchmarks/demo_runs.py) at --seq-length on mock data,
once with Gated DeltaNet layers three in four (16 heads of 32 dimensions where softmax attention has 4 of 32)
and once with softmax attention everywhere; tokens/s from the training log's records after the first, and the
final loss. Appends the figures with date, machine and command to benchmarks/results/gated_delta_net.jsonl.

    python -m benchmarks.gated_delta_net [--seq-length 1024] [--heads 8] [--repeats 5] [--iters 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from benchmarks.results_file import record_result

LINEAR = {"experimental_attention_variant": "gated_delta_net", "linear_attention_freq": 4,
          "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 32,
          "linear_value_head_dim": 32}


def _rule_inputs(seq_length: int, heads: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, seq_length, heads, 128, generator=generator), dim=-1)
            for _ in range(2))
    v = torch.randn(1, seq_length, heads, 128, generator=generator)
    g = -torch.nn.functional.softplus(torch.randn(1, seq_length, heads, generator=generator))
    beta = torch.sigmoid(torch.randn(1, seq_length, heads, generator=generator))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def time_rules(seq_length: int, heads: int, repeats: int) -> dict:
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from megatron_lite.model.linear_attention.delta_rule import chunk_gated_delta_rule

    inputs = _rule_inputs(seq_length, heads)
    rules = {"megatron_lite": lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, scale=128 ** -0.5)[0],
             "transformers": lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(q, k, v, g, beta)[0]}
    with torch.no_grad():
        ours, theirs = (rule(*inputs) for rule in rules.values())
    difference = float((ours - theirs).abs().max() / theirs.abs().max())
    seconds = {name: [] for name in rules}
    for _ in range(repeats + 1):  # the first round warms up
        for name, rule in rules.items():
            start = time.perf_counter()
            rule(*inputs).sum().backward()
            seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(times[1:]) for name, times in seconds.items()}
    return {"max_relative_difference": difference, "forward_backward_s": medians,
            "ours_over_transformers": medians["megatron_lite"] / medians["transformers"]}


def train(values: dict, iters: int, seq_length: int) -> dict:
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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=12)
    args = parser.parse_args(argv[1:])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    rule = time_rules(args.seq_length, args.heads, args.repeats)
    print("rule", rule, flush=True)
    runs = {"hybrid": train(LINEAR, args.iters, args.seq_length), "softmax": train({}, args.iters, args.seq_length)}
    print("training", runs, flush=True)
    record_result("gated_delta_net", {"seq_length": args.seq_length, "heads": args.heads, "rule": rule,
                                      "training": runs, "hybrid_over_softmax_tokens_per_sec":
                                          runs["hybrid"]["tokens_per_sec"] / runs["softmax"]["tokens_per_sec"]},
                  argv)


if __name__ == "__main__":
    main(sys.argv)
