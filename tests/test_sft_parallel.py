"""Supervised fine-tuning trains as one process under every parallel dimension: TP2 + SP, PP2, CP2 (each
conversation padded to the load-balanced split's granularity), EP2 (an MoE model) and ZeRO-3 over DP2; and a run
saved at DP2 resumes on one process with exactly the next rows."""

from __future__ import annotations

import pytest

from tests.chat_data import write_messages, write_tokenizer
from tests.harness import run_on_ranks
from tests.helpers import (
    assert_layouts_match,
    assert_run_matches,
    losses_and_norms,
    reference,
    train_and_collect,
    train_losses,
)

LAYOUTS = {  # on 2 ranks
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
}
ZERO3 = {"use_distributed_optimizer": True, "data_parallel_sharding_strategy": "optim_grads_params"}
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.01}


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> dict:
    """A tiny Llama fine-tuned on a few dozen conversations, one row a sample."""
    root = tmp_path_factory.mktemp("sft")
    return {"model_preset": "llama-tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
            "num_attention_heads": 4, "num_query_groups": 2, "make_vocab_size_divisible_by": 256,
            "seq_length": 160, "max_position_embeddings": 160,
            "micro_batch_size": 1, "global_batch_size": 4, "train_iters": 4, "lr": 3e-3, "lr_warmup_iters": 1,
            "eval_interval": 1000, "log_interval": 1000, "sft": True, "split": "100,0,0",
            "data_path": [write_messages(root / "chat.jsonl", repeat=5)], "tokenizer_type": "HuggingFaceTokenizer",
            "tokenizer_model": write_tokenizer(root / "tokenizer")}


def _train_layouts(values: dict) -> tuple:
    runs = {name: train_and_collect({**values, **flags}, 2) for name, flags in LAYOUTS.items()}
    return runs, losses_and_norms({**values, **ZERO3}, 2)


def test_sft_trains_as_one_process_under_tp_sp_pp_cp_and_zero3(sft):
    """Losses, final weights and last gradients equal one process's; under ZeRO-3 over DP2 every step's loss and
    gradient norm."""
    assert_layouts_match(run_on_ranks(2, _train_layouts, sft), LAYOUTS, reference(sft), losses_and_norms(sft, 1))


def _train_ep2(values: dict):
    return train_and_collect({**values, **MOE, "expert_model_parallel_size": 2}, 2)


def test_sft_of_an_moe_model_trains_as_one_process_under_ep2(sft):
    assert_run_matches(run_on_ranks(2, _train_ep2, sft), reference({**sft, **MOE}), rel=1e-5, tensor_rel=1e-4)


def test_an_sft_run_saved_at_dp2_resumes_on_one_process_with_the_next_rows(sft, tmp_path):
    uninterrupted = train_losses(sft, 1)
    saved = run_on_ranks(2, train_losses, {**sft, "save": str(tmp_path), "exit_interval": 2}, 2)
    assert saved[0] == pytest.approx(uninterrupted[:2], rel=1e-5)
    assert train_losses({**sft, "load": str(tmp_path)}, 1) == pytest.approx(uninterrupted[2:], rel=1e-5)
