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

import sys

import torch

from benchmarks.mixer_runs import compare, time_in_turn

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

    q, k, v, g, beta = _rule_inputs(seq_length, heads)
    rules = {"megatron_lite": lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta, scale=128 ** -0.5)[0],
             "transformers": lambda q, k, v, g, beta: torch_chunk_gated_delta_rule(q, k, v, g, beta)[0]}
    return time_in_turn(rules, {"q": q, "k": k, "v": v, "g": g, "beta": beta}, repeats)


def main(argv: list[str]) -> None:
    compare(argv, __doc__.splitlines()[0], "gated_delta_net", "rule", time_rules, LINEAR, {})


if __name__ == "__main__":
    main(sys.argv)
