"""Expert parallelism trains exactly as one process holding every expert.

EP 1, 2 and 4 (with expert-data-parallel replicas), EP2 x TP2 with and without sequence parallelism,
EP2 x PP2, EP4 over DP2 x CP2, the allgather dispatcher, and EP2 with the distributed optimizer and full
recomputation; and a model with a gated shared expert, sigmoid routing with an expert bias, group-limited
routing and the per-sequence aux loss on EP2 x TP2 x SP, EP4 x CP2, EP2 x PP2 x ZeRO-2 and EP2 x PP2 under the
ZB-H1 schedule (its backward split into input and weight passes around the experts' grouped GEMM): the losses
of 4 steps (a warm-up step, then three with Adam's state) and the logged aux loss, z-loss and tokens per expert
equal the single-device run's, and so do the first step's gradients of every router, expert and shared-expert
weight (later steps' weights differ by Adam-amplified rounding; sharded gradients are not compared). With a
capacity factor the same token copies are dropped on every layout. One 4-rank world runs every layout.
"""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.model.sharding import unshard
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks
from tests.helpers import EQUIVALENCE_ITERS, pretrain_keeping_chunks

# Four layers with --moe-layer-freq 2: MoE layers 0 and 2 (one on each stage of a 2-stage pipeline), dense 1, 3.
MOE = {
    "model_preset": "mixtral-tiny", "mock_data": True, "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
    "moe_ffn_hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 256,
    "num_experts": 4, "moe_router_topk": 2, "moe_layer_freq": 2, "moe_aux_loss_coeff": 0.01,
    "moe_z_loss_coeff": 0.001, "seq_length": 32, "max_position_embeddings": 32, "micro_batch_size": 2,
    "global_batch_size": 8, "train_iters": EQUIVALENCE_ITERS, "lr": 3e-3, "lr_warmup_iters": 1, "eval_interval": 1000,
    "log_interval": 1,
}
ONE_STEP = {**MOE, "train_iters": 1, "lr_warmup_iters": 0}  # a warmup must end before the decay
CAPACITY = {**MOE, "moe_expert_capacity_factor": 1.0, "train_iters": 4}

LAYOUTS = {  # name: flags on top of MOE, on 4 ranks
    "ep1_dp4": {"expert_model_parallel_size": 1},
    "ep2_dp4": {"expert_model_parallel_size": 2},
    "ep4": {"expert_model_parallel_size": 4},
    "ep2_tp2_sp": {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
    "ep2_tp2": {"expert_model_parallel_size": 2, "tensor_model_parallel_size": 2},
    "ep2_pp2": {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "ep2_allgather": {"expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"},
    "ep4_cp2": {"expert_model_parallel_size": 4, "context_parallel_size": 2},
    "ep2_zero2_recompute": {"expert_model_parallel_size": 2, "data_parallel_sharding_strategy": "optim_grads",
                            "recompute_granularity": "full"},
}
# Shared expert with Qwen2-MoE's gate, sigmoid routing scaled by 2, aux-loss-free expert bias, group-limited
# routing and the per-sequence aux loss: its own single-device reference (4 steps), on three layouts.
MODERN = {**MOE, "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.0,
          "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.002,
          "moe_router_load_balancing_type": "seq_aux_loss", "moe_router_num_groups": 2, "moe_router_group_topk": 1,
          "moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True, "train_iters": 4}
MODERN_ONE_STEP = {**MODERN, "train_iters": 1, "lr_warmup_iters": 0}
MODERN_LAYOUTS = {
    "modern_ep2_tp2_sp": LAYOUTS["ep2_tp2_sp"],
    "modern_ep4_cp2": LAYOUTS["ep4_cp2"],
    "modern_ep2_pp2_zero2": {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                             "data_parallel_sharding_strategy": "optim_grads"},
    "modern_ep2_pp2_zb_h1": {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                             "pipeline_schedule": "zb-h1"},
}
SHARDED_GRADS = {"ep2_zero2_recompute", "modern_ep2_pp2_zero2"}  # gradients live as data-parallel shards: losses only
CAPACITY_LAYOUTS = ("ep4", "ep2_tp2_sp", "ep2_pp2", "ep2_allgather", "ep4_cp2")


def _train(values: dict, world_size: int) -> dict:
    """Losses and MoE metrics per step; the last step's gradients of the router, expert and shared-expert
    weights as {global name: (tp rank, spec, tensor)}, this rank's pieces; the routers' expert biases."""
    history, chunks = pretrain_keeping_chunks(values, world_size)
    grads = {name: (chunk.pstate.tp_rank, param.spec, param.main_grad.clone())
             for chunk in chunks for name, param in chunk.named_global_parameters()
             if ".mlp." in name and name.split(".mlp.")[1].startswith(("router.", "experts.", "shared_experts."))
             and param.main_grad is not None}
    biases = {name: buffer.clone() for chunk in chunks for name, buffer in chunk.named_global_buffers()}
    return {"history": history, "grads": grads, "biases": biases}


def _train_layouts(runs: list[tuple[str, dict]], world_size: int) -> dict:
    return {name: _train(values, world_size) for name, values in runs}


def _join(rank_results: list[dict], key: str) -> dict:
    """{global name: global tensor} from every rank's pieces; every replica of a piece must agree."""
    pieces: dict[str, dict] = {}
    for result in rank_results:
        for name, (tp_rank, spec, tensor) in result[key].items():
            held = pieces.setdefault(name, {})
            if tp_rank in held:  # a data-parallel (expert-data-parallel) replica
                assert _relative_error(tensor, held[tp_rank][1]) < 1e-6, f"replicas of {name} differ"
            held[tp_rank] = (spec, tensor)
    return {name: unshard([by_rank[r][1] for r in sorted(by_rank)], by_rank[0][0]) for name, by_rank in pieces.items()}


def _relative_error(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def _assert_runs_match(name: str, rank_results: list[dict], reference: dict, compare_grads: bool = False):
    for rank, result in enumerate(rank_results):  # every rank logs the same global figures
        for step, (got, expected) in enumerate(zip(result["history"], reference["history"], strict=True)):
            where = f"{name} rank {rank} step {step + 1}"
            assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), where
            for key, value in expected.items():
                if key.startswith("moe_tokens_per_expert") or key.startswith("moe_dropped"):
                    assert got[key] == value, f"{where} {key}"
                elif key.startswith("moe_"):
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), f"{where} {key}"
    if compare_grads:
        joined, expected = _join(rank_results, "grads"), _join([reference], "grads")
        assert joined.keys() == expected.keys(), f"{name}: router/expert parameter names differ"
        for param_name, tensor in joined.items():
            error = _relative_error(tensor, expected[param_name])
            assert error < 1e-5, f"{name}: gradient of {param_name} off by {error:.2e}"


@pytest.fixture(scope="module")
def references():
    return {"dropless": _train(MOE, 1), "one_step": _train(ONE_STEP, 1), "capacity": _train(CAPACITY, 1),
            "modern": _train(MODERN, 1), "modern_one_step": _train(MODERN_ONE_STEP, 1),
            "modern_three_steps": _train({**MODERN, "train_iters": 3}, 1)}


@pytest.fixture(scope="module")
def parallel_runs():
    runs = [(name, {**MOE, **flags}) for name, flags in LAYOUTS.items()]
    runs += [(f"one_step_{name}", {**ONE_STEP, **flags}) for name, flags in LAYOUTS.items()
             if name not in SHARDED_GRADS]
    runs += [(f"capacity_{name}", {**CAPACITY, **LAYOUTS[name]}) for name in CAPACITY_LAYOUTS]
    runs += [(name, {**MODERN, **flags}) for name, flags in MODERN_LAYOUTS.items()]
    runs += [(f"one_step_{name}", {**MODERN_ONE_STEP, **flags}) for name, flags in MODERN_LAYOUTS.items()
             if name not in SHARDED_GRADS]
    per_rank = run_on_ranks(4, _train_layouts, runs, 4, timeout=900)
    return {name: [ranks[name] for ranks in per_rank] for name, _ in runs}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_single_device(layout, references, parallel_runs):
    _assert_runs_match(layout, parallel_runs[layout], references["dropless"])
    if layout not in SHARDED_GRADS:
        _assert_runs_match(layout, parallel_runs[f"one_step_{layout}"], references["one_step"], compare_grads=True)


@pytest.mark.parametrize("layout", list(MODERN_LAYOUTS))
def test_shared_expert_sigmoid_bias_and_group_routing_match_single_device(layout, references, parallel_runs):
    """Losses, logged balance and first-step gradients equal one process; after 4 iterations every rank
    holds the same expert biases, bit for bit, and they are the single device's."""
    _assert_runs_match(layout, parallel_runs[layout], references["modern"])
    if layout not in SHARDED_GRADS:
        _assert_runs_match(layout, parallel_runs[f"one_step_{layout}"], references["modern_one_step"],
                           compare_grads=True)
    expected = references["modern"]["biases"]
    assert any(bias.abs().sum() > 0 for bias in expected.values())
    held = {}
    for result in parallel_runs[layout]:
        for name, bias in result["biases"].items():
            assert torch.equal(held.setdefault(name, bias), bias), f"{layout}: ranks hold different {name}"
    assert held.keys() == expected.keys()
    for name, bias in held.items():
        assert torch.equal(bias, expected[name]), f"{layout}: {name} differs from one process"


def test_reference_run_trains_and_logs_load_balance(references):
    history = references["dropless"]["history"]
    assert history[-1]["lm_loss"] < history[0]["lm_loss"]
    tokens_per_step = MOE["global_batch_size"] * MOE["seq_length"] * MOE["moe_router_topk"]
    for record in history:
        for layer in (0, 2):
            assert sum(record[f"moe_tokens_per_expert_layer_{layer}"]) == tokens_per_step
            assert record[f"moe_aux_loss_layer_{layer}"] >= MOE["moe_aux_loss_coeff"] * 0.999  # 1 x coeff if balanced
            assert record[f"moe_z_loss_layer_{layer}"] > 0
            assert record[f"moe_dropped_tokens_layer_{layer}"] == 0
        assert "moe_aux_loss_layer_1" not in record  # a dense layer


@pytest.mark.parametrize("layout", CAPACITY_LAYOUTS)
def test_capacity_drops_the_same_tokens_on_every_layout(layout, references, parallel_runs):
    reference = references["capacity"]
    assert all(record["moe_dropped_tokens_layer_0"] > 0 for record in reference["history"])
    _assert_runs_match(f"capacity_{layout}", parallel_runs[f"capacity_{layout}"], reference)


def _train_losses_and_biases(values: dict, world_size: int) -> tuple[list[float], dict]:
    result = _train(values, world_size)
    return [record["lm_loss"] for record in result["history"]], result["biases"]


def test_expert_bias_checkpoint_saved_with_ep4_resumes_on_one_process(tmp_path, references):
    """Expert biases are saved under global names: 3 steps on EP4, the 4th on one process; the saved (non-zero)
    and the final biases are the single-device run's, bit for bit, and so the losses follow it."""
    saved, saved_biases = run_on_ranks(4, _train_losses_and_biases, {**MODERN, "expert_model_parallel_size": 4,
                                                                     "exit_interval": 3, "save": str(tmp_path)}, 4)[0]
    assert all(bias.abs().sum() > 0 for bias in saved_biases.values())
    for name, bias in references["modern_three_steps"]["biases"].items():
        assert torch.equal(saved_biases[name], bias), name
    resumed, final_biases = _train_losses_and_biases({**MODERN, "load": str(tmp_path)}, 1)
    for name, bias in references["modern"]["biases"].items():
        assert torch.equal(final_biases[name], bias), name
    expected = [record["lm_loss"] for record in references["modern"]["history"]]
    assert saved + resumed == pytest.approx(expected, rel=1e-5)


def _train_losses(values: dict, world_size: int) -> list[float]:
    history = pretrain(make_config(values, world_size), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    return [record["lm_loss"] for record in history]


def test_expert_checkpoint_saved_with_ep4_resumes_on_one_process(tmp_path, references):
    """Experts are saved under their global names: 2 steps on EP4, the next 2 on one process holding all."""
    saved = run_on_ranks(4, _train_losses, {**MOE, "expert_model_parallel_size": 4, "exit_interval": 2,
                                           "save": str(tmp_path)}, 4)[0]
    resumed = _train_losses({**MOE, "load": str(tmp_path), "exit_interval": 4}, 1)
    expected = [record["lm_loss"] for record in references["dropless"]["history"][:4]]
    assert saved + resumed == pytest.approx(expected, rel=1e-5)
