"""Mamba-2 on the CPU: the chunked SSD scan against transformers' own torch implementation of it (the Nemotron-H
reference path, `mamba2_chunk_scan`), and whole training runs of a Mamba-2 hybrid against the softmax-only model
of the same shape.

The scan: forward and backward of one [b, s, heads, 64] scan with 8 groups of state 128 in fp32 (no documents),
ours and transformers' on the same inputs, taken in turn, the median of --repeats; their outputs are compared
first. Training: pretrain() of the llama-tiny shape at --seq-length on mock data, once as Nemotron-H's form
(M-M-M-*-: Mamba-2 mixers three in four, 8 heads of 32 in 2 groups of state 64, beside the attention's 4 heads of
32) and once with softmax attention everywhere (*-*-*-*-); tokens/s from the training log's records after the
first, and the final loss. Appends the figures with date, machine and command to benchmarks/results/mamba2.jsonl.

    python -m benchmarks.mamba2 [--seq-length 1024] [--heads 8] [--repeats 5] [--iters 12]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.mixer_runs import compare, time_in_turn

MAMBA = {"mamba_num_heads": 8, "mamba_head_dim": 32, "mamba_num_groups": 2, "mamba_state_dim": 64}


def _scan_inputs(seq_length: int, heads: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(1, seq_length, heads, 64, generator=generator),
              "dt": F.softplus(torch.randn(1, seq_length, heads, generator=generator) - 3),
              "A": -torch.rand(heads, generator=generator) - 0.5,
              "B": torch.randn(1, seq_length, 8, 128, generator=generator),
              "C": torch.randn(1, seq_length, 8, 128, generator=generator), "D": torch.ones(heads)}
    return {name: t.requires_grad_() for name, t in inputs.items()}


def time_scans(seq_length: int, heads: int, repeats: int) -> dict:
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    from megatron_lite.model.mamba.ssd import CHUNK_SIZE, ssd_chunked

    scans = {"megatron_lite": lambda x, dt, A, B, C, D: ssd_chunked(x, dt, A, B, C, D, chunk_size=CHUNK_SIZE)[0],
             "transformers": lambda x, dt, A, B, C, D: mamba2_chunk_scan(x, dt, A, B, C, CHUNK_SIZE, D=D)}
    return time_in_turn(scans, _scan_inputs(seq_length, heads), repeats)


def main(argv: list[str]) -> None:
    compare(argv, __doc__.splitlines()[0], "mamba2", "scan", time_scans,
            {**MAMBA, "num_layers": None, "hybrid_layer_pattern": "M-M-M-*-"},
            {"num_layers": None, "hybrid_layer_pattern": "*-*-*-*-"})


if __name__ == "__main__":
    main(sys.argv)
