"""One-process training runs of the demo model (llama-tiny, examples/demo_cpu.sh) that benchmarks compare:
the demo corpus when it is built (data/shakespeare_text_document, data/README.md), else mock data, which the
returned source says; the shared flags of such a run; and its final losses."""

from __future__ import annotations

import json
import os

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import pretrain

CORPUS = "data/shakespeare_text_document"
TOKENIZER = "data/tokenizer.model"


def data_flags() -> tuple[dict, str]:
    """The demo corpus's flags when it is built, else mock data's; and which one."""
    if os.path.exists(CORPUS + ".idx") and os.path.exists(TOKENIZER):
        return {"data_path": [CORPUS], "split": "969,30,1", "tokenizer_type": "SentencePieceTokenizer",
                "tokenizer_model": TOKENIZER}, "demo corpus (Shakespeare)"
    return {"mock_data": True, "vocab_size": 4000}, "mock data (the demo corpus is not built here)"


def demo_values(iters: int, micro_batch_size: int, global_batch_size: int, data: dict) -> dict:
    """The demo model in bf16 on the CPU, seq 128, `iters` iterations with a warmup of 1/15 of them, weight
    decay 0.1, one validation after the last iteration, seed 1234."""
    return {"model_preset": "llama-tiny", "device": "cpu", "bf16": True, "seq_length": 128,
            "micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size, "train_iters": iters,
            "lr_warmup_iters": max(iters // 15, 1), "weight_decay": 0.1, "eval_interval": iters, "seed": 1234,
            **data}


def train(values: dict, metrics_path: str) -> dict:
    """Final training loss (mean of the last 10 iterations) and the validation loss after the last one."""
    history = pretrain(make_config({**values, "metrics_jsonl": metrics_path}, 1), pretrain_gpt.model_provider,
                       pretrain_gpt.forward_step)
    with open(metrics_path) as f:
        valid = [r["valid_lm_loss"] for r in map(json.loads, f) if "valid_lm_loss" in r]
    losses = [h["lm_loss"] for h in history]
    return {"final_train_loss": sum(losses[-10:]) / len(losses[-10:]), "final_valid_loss": valid[-1],
            "first_train_loss": losses[0]}
