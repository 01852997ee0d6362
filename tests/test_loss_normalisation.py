"""The loss normalisation: Megatron's per-micro-batch mean by default, the global token mean with
--calculate-per-token-loss.

With --eod-mask-loss the micro-batches hold different numbers of unmasked tokens, so the two differ. The
gradients of one step are checked against references written here from Megatron's definitions
(megatron/core/pipeline_parallel/schedules.py forward_step_calc_loss, distributed_data_parallel.py's
1 / (dp x cp) gradient scaling, finalize_model_grads' division by the global token count), with an MoE model
too; and TP2 x DP2 x PP2 and CP2 x DP2 train as one process in both normalisations.
"""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.loop import (
    build_data_iterator,
    build_datasets,
    build_model,
    get_schedule,
    initialize,
    reduce_loss,
)
from tests.harness import run_on_ranks
from tests.helpers import losses_and_norms
from tests.tolerances import assert_close_relative

VOCAB, SEQ = 16, 16  # mock data's EOD is VOCAB - 1: a few per sample, so the loss masks differ
DENSE = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
         "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": VOCAB, "make_vocab_size_divisible_by": 8,
         "seq_length": SEQ, "max_position_embeddings": SEQ, "micro_batch_size": 2, "global_batch_size": 4,
         "eod_mask_loss": True, "train_iters": 3, "lr": 3e-3, "lr_warmup_iters": 1, "eval_interval": 1000,
         "log_interval": 1000}
MOE = {**DENSE, "model_preset": "mixtral-tiny", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
       "moe_aux_loss_coeff": 0.1, "moe_z_loss_coeff": 0.01}


def one_step_gradients(values: dict) -> tuple[list[dict], dict[str, torch.Tensor], float]:
    """One process: the micro-batches of the first global batch, the gradients after the schedule and
    finalize_model_grads, and the reported loss."""
    config = make_config(values)
    pstate, device = initialize(config)
    model = build_model(config, pstate, pretrain_gpt.model_provider, device)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    batches = [next(iterator) for _ in range(config.num_microbatches)]
    reports, tokens = get_schedule(config)(pretrain_gpt.forward_step, iter(batches), model, len(batches),
                                           pstate=pstate, config=config)
    finalize_model_grads(model, pstate, tokens)
    grads = {name: p.main_grad.clone() for name, p in model[0].module.named_global_parameters()}
    return batches, grads, float(reduce_loss(reports, pstate, device))


def megatron_reference(values: dict, batches: list[dict], per_token: bool) -> tuple[dict[str, torch.Tensor], float]:
    """Megatron's gradient of one global batch on one process, and its reported loss, from the model alone.

    Per micro-batch: the loss of micro-batch i is s_i / n_i (its masked per-token loss sum over its unmasked
    tokens), divided by the m micro-batches; an MoE layer's balancing losses weigh 1 / m each. Per token:
    sum_i s_i / N with N = sum_i n_i; the balancing losses weigh T / N, T the tokens of a micro-batch
    (Megatron's router multiplies them by its tokens). Outside a schedule a layer weighs its losses by T
    (tests/test_moe.py checks that against a direct computation), so each micro-batch backpropagates
    T s_i / n_i (per micro-batch) or s_i (per token) and the sum is divided by T m or N. Reported in both
    (megatron/training/training.py): sum_i s_i / N.
    """
    config = make_config(values)
    model = pretrain_gpt.model_provider(config, ParallelState.single(), model_chunk_plans(config, 0)[0],
                                        torch.device("cpu"))  # the same initial weights: layout-independent
    tokens_per_microbatch = config.training.micro_batch_size * config.model.seq_length
    total_sum, total_tokens = 0.0, 0.0
    for batch in batches:
        per_token_loss = model(batch["tokens"], batch["position_ids"], labels=batch["labels"])  # [b, s]
        loss_sum, num_tokens = (per_token_loss * batch["loss_mask"]).sum(), batch["loss_mask"].sum()
        (loss_sum if per_token else tokens_per_microbatch * loss_sum / num_tokens).backward()
        total_sum, total_tokens = total_sum + float(loss_sum.detach()), total_tokens + float(num_tokens)
    divisor = total_tokens if per_token else tokens_per_microbatch * len(batches)
    return {name: p.grad / divisor for name, p in model.named_global_parameters()}, total_sum / total_tokens


@pytest.mark.parametrize("values", [DENSE, MOE], ids=["dense", "moe"])
def test_one_step_follows_megatrons_definition_in_both_normalisations(values):
    results = {}
    for per_token in (False, True):
        batches, grads, loss = one_step_gradients({**values, "calculate_per_token_loss": per_token})
        counts = [int(batch["loss_mask"].sum()) for batch in batches]
        assert len(set(counts)) > 1, f"the micro-batches should hold different token counts: {counts}"
        expected, expected_loss = megatron_reference(values, batches, per_token)
        for name, grad in grads.items():
            assert_close_relative(grad, expected[name], rel=1e-5, msg=f"per_token={per_token} {name}")
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        results[per_token] = grads
    difference = max(float((results[True][n] - results[False][n]).abs().max() / results[True][n].abs().max())
                     for n in results[True] if results[True][n].abs().max() > 0)
    assert difference > 1e-3, "with unequal token counts the normalisations should give different gradients"


def test_without_a_loss_mask_the_normalisations_agree():
    """Every micro-batch then holds micro-batch-size x seq-length tokens: the mean of the means is the mean."""
    plain = {**MOE, "eod_mask_loss": False}
    _, per_microbatch, loss = one_step_gradients(plain)
    _, per_token, token_loss = one_step_gradients({**plain, "calculate_per_token_loss": True})
    assert loss == pytest.approx(token_loss, rel=1e-6)
    for name, grad in per_token.items():
        assert_close_relative(per_microbatch[name], grad, rel=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------------
# Parallel layouts equal one process in both normalisations

LAYOUT_RUN = {**DENSE, "micro_batch_size": 1, "global_batch_size": 8}
LAYOUTS = {8: {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},  # x DP2
           4: {"context_parallel_size": 2}}  # x DP2


def _both_normalisations(values: dict, world_size: int) -> list[list[tuple[float, float]]]:
    return [losses_and_norms({**values, "calculate_per_token_loss": per_token}, world_size)
            for per_token in (False, True)]


@pytest.mark.parametrize("world_size", sorted(LAYOUTS), ids=["cp2_dp2", "tp2_dp2_pp2"])
def test_layouts_train_as_one_process_in_both_normalisations(world_size):
    """Losses and gradient norms of 3 steps with --eod-mask-loss (CP2 splits each sequence, and so its loss
    mask, unevenly between the two cp ranks)."""
    values = {**LAYOUT_RUN, **LAYOUTS[world_size]}
    expected = _both_normalisations(LAYOUT_RUN, 1)
    flat = [[value for pair in run for value in pair] for run in expected]
    assert flat[0] != pytest.approx(flat[1], rel=1e-3), "the normalisations should train differently"
    for rank, runs in enumerate(run_on_ranks(world_size, _both_normalisations, values, world_size)):
        for per_token, (got, want) in enumerate(zip(runs, expected, strict=True)):
            for step, (pair, reference) in enumerate(zip(got, want, strict=True)):
                assert pair == pytest.approx(reference, rel=1e-5), f"rank {rank} per_token={per_token} step {step}"
