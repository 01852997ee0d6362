"""Data parallelism: DP=2 trains exactly as one process on the same global batch."""

import json

import pytest
import torch

from tests.harness import run_on_ranks
from tests.helpers import losses_and_norms

TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "seq_length": 32,
        "max_position_embeddings": 32, "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 6,
        "lr": 3e-3, "lr_warmup_iters": 1, "eval_interval": 1000, "log_interval": 1000}


def test_dp2_losses_equal_single_process():
    reference = losses_and_norms(TINY, 1)
    results = run_on_ranks(2, losses_and_norms, TINY, 2)
    for rank_result in results:  # every rank reports the same global loss
        for (loss, norm), (ref_loss, ref_norm) in zip(rank_result, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert reference[-1][0] < reference[0][0]


def test_gpt2_tied_embeddings_dp2_with_overlap_equals_single_process():
    values = {**TINY, "model_preset": "gpt2-124m", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "ffn_hidden_size": 256, "vocab_size": 500, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    reference = losses_and_norms(values, 1)
    overlapped = run_on_ranks(2, losses_and_norms, {**values, "overlap_grad_reduce": True}, 2)[0]
    for (loss, norm), (ref_loss, ref_norm) in zip(overlapped, reference):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert norm == pytest.approx(ref_norm, rel=1e-5)


def test_loss_is_a_token_mean_whatever_the_micro_batch_split(tmp_path):
    one_micro_batch = losses_and_norms({**TINY, "micro_batch_size": 8}, 1)
    four_micro_batches = losses_and_norms(TINY, 1)
    for (a, _), (b, _) in zip(one_micro_batch, four_micro_batches):
        assert a == pytest.approx(b, rel=1e-5)


def test_metrics_jsonl_has_one_record_per_iteration(tmp_path):
    path = tmp_path / "metrics.jsonl"
    losses_and_norms({**TINY, "metrics_jsonl": str(path)}, 1)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, TINY["train_iters"] + 1))
    for key in ("lm_loss", "grad_norm", "lr", "tokens_per_sec", "consumed_samples"):
        assert all(key in r for r in records)
    assert records[-1]["consumed_samples"] == TINY["train_iters"] * TINY["global_batch_size"]
    assert torch.isfinite(torch.tensor([r["lm_loss"] for r in records])).all()
