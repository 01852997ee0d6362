"""Whole models under tensor (and sequence) parallelism equal the single-device model.

GPT-2-like (LayerNorm, GELU, learned positions, biases, tied embeddings) and Llama-like (RMSNorm,
SwiGLU, RoPE, GQA, untied) models at TP 2 and 4, with and without sequence parallelism, on a 4-rank
world (the remaining ranks are data-parallel replicas that each take their share of the batch): the
logits, the initial weights and every parameter's gradient after finalize_model_grads, gathered over
TP, equal the single-device model's. Then 10 training steps of TP2 x DP2 equal one process.
"""

import pytest
import torch

from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import run_on_ranks
from tests.helpers import BATCH, SMALL, forward_backward, losses_and_norms
from tests.tolerances import assert_close_relative

MODELS = {
    "gpt2": {**SMALL, "model_preset": "gpt2-124m", "num_attention_heads": 4, "ffn_hidden_size": 128},
    "llama_gqa": {**SMALL, "model_preset": "llama-tiny", "num_attention_heads": 8, "num_query_groups": 4,
                  "ffn_hidden_size": 96},
}
LAYOUTS = [(tp, sp) for tp in (2, 4) for sp in (False, True)]


def run_model_cases():
    """Every model at every layout; results from TP rank 0 of each data-parallel rank."""
    results = {}
    for tp, sp in LAYOUTS:
        pstate = ParallelState.build(Layout.from_world(4, tp=tp))
        for name, values in MODELS.items():
            values = {**values, "tensor_model_parallel_size": tp, "sequence_parallel": sp}
            result = forward_backward(values, pstate, 4)
            if pstate.tp_rank == 0:  # the other TP ranks gathered the same tensors
                results[(name, tp, sp)] = (pstate.dp_rank, pstate.dp_size, result)
    return results


@pytest.fixture(scope="module")
def model_results():
    return run_on_ranks(4, run_model_cases)


@pytest.fixture(scope="module")
def references():
    return {name: forward_backward(values, ParallelState.single(), 1) for name, values in MODELS.items()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("tp", "sequence_parallel"), LAYOUTS)
def test_tp_model_matches_single_device(model_results, references, name, tp, sequence_parallel):
    reference = references[name]
    checked_rows = 0
    for rank_results in model_results:
        if (name, tp, sequence_parallel) not in rank_results:
            continue
        dp_rank, dp_size, got = rank_results[(name, tp, sequence_parallel)]
        rows = BATCH // dp_size
        assert_close_relative(got["logits"], reference["logits"][dp_rank * rows:(dp_rank + 1) * rows], rel=1e-5)
        checked_rows += rows
        assert got["weights"].keys() == reference["grads"].keys()
        for param_name, weight in reference["weights"].items():
            assert torch.equal(got["weights"][param_name], weight), param_name
        for param_name, grad in reference["grads"].items():
            scale = grad.abs().max().item()
            assert_close_relative(got["grads"][param_name], grad, rel=1e-5, msg=param_name)
            assert scale > 0, param_name
        for param_name, padded in got["padded_grads"].items():
            assert padded.numel() > 0 and torch.count_nonzero(padded) == 0, param_name
    assert checked_rows == BATCH


# ---------------------------------------------------------------------------------------------------
# Training: TP2 x DP2 for 4 steps (two of warm-up, then two with Adam's state) equals one process

TRAIN = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 4, "lr": 3e-3, "lr_warmup_iters": 2,
         "eval_interval": 1000, "log_interval": 1000}


@pytest.mark.parametrize(("name", "sequence_parallel"), [("gpt2", True), ("llama_gqa", False)])
def test_tp2_dp2_training_matches_single_process(name, sequence_parallel):
    values = {**MODELS[name], **TRAIN}
    reference = losses_and_norms(values, 1)
    parallel = run_on_ranks(4, losses_and_norms, {**values, "tensor_model_parallel_size": 2,
                                       "sequence_parallel": sequence_parallel}, 4)
    assert len(reference) == TRAIN["train_iters"]
    for rank_history in parallel:
        assert len(rank_history) == len(reference)
        for (loss, norm), (ref_loss, ref_norm) in zip(rank_history, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert reference[-1][0] < reference[0][0]
