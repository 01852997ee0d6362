"""The layout planner under MoE parallel folding (--expert-tensor-parallel-size), and its fast enumeration.

The parameter, gradient and optimizer bytes it plans for every rank of folded layouts equal those the built model
and optimizer allocate (4 gloo ranks: TP2 x PP2 with ETP1 x EP2 at DP1, TP2 x DP2 with ETP1 x EP2 and x EP1, where a
rank's expert shard follows its stage index, TP1 x DP4 with ETP2 x EP2 and x EP1 under ZeRO-1/2/3, small buckets of
odd sizes so that padding shows, offloaded optimizer state). Candidates of an MoE preset include the folded
layouts, written out by hand, and they validate. An MoE layer's planned activation bytes are what autograd saves
(one process, routed and shared experts, fp32 and bf16); the activation and communication terms that depend on
the expert split equal figures computed by hand from their definitions. The enumeration that shares bucket cuts and
skips layouts whose state alone cannot fit plans exactly the layouts, with exactly the figures, that planning
every candidate on its own gives.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import pretrain_gpt
from megatron_lite.config import layer_specs
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.errors import ConfigError
from megatron_lite.model.kinds.moe import moe_mlp_bytes
from megatron_lite.model.moe.layer import MoELayer
from megatron_lite.parallel.state import ParallelState
from megatron_lite.planning.activation_memory import layer_bytes
from megatron_lite.planning.layouts import candidate_flags, enumerate_plans, plan_layout
from megatron_lite.planning.report import plan_record
from megatron_lite.planning.state_memory import stage_state_bytes
from megatron_lite.planning.step_time import Hardware, data_parallel_bytes, predict_step_time
from tests.harness import run_on_ranks
from tests.test_plan_layout import LLAMA, built_and_planned
from tools import plan_layout as plan_layout_tool

MOE = {**LLAMA, "model_preset": "mixtral-tiny", "num_experts": 4, "moe_ffn_hidden_size": 96}
# An odd hidden size (heads of kv-channels 16) and odd expert widths per rank make buckets of odd sizes, so their
# padding shows and the expert shard a rank holds (its stage index // (etp ep)) decides what it steps.
ODD_ETP1 = {**MOE, "hidden_size": 63, "kv_channels": 16, "moe_ffn_hidden_size": 45, "expert_tensor_parallel_size": 1}
ODD_ETP2 = {**ODD_ETP1, "moe_ffn_hidden_size": 90, "expert_tensor_parallel_size": 2}
SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
FOLDED = {
    "tp2_sp_pp2_etp1_ep2_zero1": {**ODD_ETP1, **SP, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                  "use_distributed_optimizer": True},
    "tp2_sp_dp2_etp1_ep2_zero1_bf16": {**ODD_ETP1, **SP, "expert_model_parallel_size": 2,
                                       "use_distributed_optimizer": True, "bf16": True, "ddp_bucket_size": 3000},
    "tp2_sp_dp2_etp1_ep1_zero3": {**ODD_ETP1, **SP, "data_parallel_sharding_strategy": "optim_grads_params",
                                  "ddp_bucket_size": 3000},
    "tp1_dp4_etp2_ep2_zero2": {**ODD_ETP2, "expert_model_parallel_size": 2,
                               "data_parallel_sharding_strategy": "optim_grads", "ddp_bucket_size": 5000},
    "tp1_dp4_etp2_ep1_zero3_bf16": {**ODD_ETP2, "data_parallel_sharding_strategy": "optim_grads_params",
                                    "bf16": True, "ddp_bucket_size": 4000},
    "tp2_sp_dp2_etp1_ep2_zero1_offload_0.4": {**ODD_ETP1, **SP, "expert_model_parallel_size": 2,
                                              "use_distributed_optimizer": True, "ddp_bucket_size": 3000,
                                              "optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.4},
}

MOE_LAYER = layer_specs.LayerSpec(layer_specs.ATTENTION, layer_specs.MOE)


@pytest.mark.parametrize("name", FOLDED)
def test_planned_state_bytes_of_folded_layouts_equal_the_built_model_on_every_rank(name):
    results = run_on_ranks(4, built_and_planned, FOLDED[name], 4)
    for rank, result in enumerate(results):
        assert result["planned"] == result["built"], f"rank {rank}"


def test_the_candidates_of_a_moe_preset_include_folded_layouts():
    """mixtral-tiny (8 experts, moe-ffn-hidden-size 256) on 4 ranks: with TP2 (dp x cp 2) EP 1 or 2 and each ETP
    dividing 4 / ep; with TP1 also EP4. A folded layout names its ETP, runs sequence parallelism where TP > 1 and
    one distributed-optimizer instance, and validates (at TP1 and TP2)."""
    base = {"model_preset": "mixtral-tiny", "mock_data": True, "global_batch_size": 8}
    candidates = list(candidate_flags(base, 4, 8, ("1f1b",)))
    seen: dict[int, set] = {}
    for flags in candidates:
        if flags["context_parallel_size"] == flags["pipeline_model_parallel_size"] == 1:
            tp = flags["tensor_model_parallel_size"]
            seen.setdefault(tp, set()).add((flags.get("expert_model_parallel_size", 1),
                                            flags.get("expert_tensor_parallel_size", tp)))
    assert seen == {1: {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1)}, 2: {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)},
                    4: {(1, 1), (1, 2), (1, 4)}}
    folded = [flags for flags in candidates if "expert_tensor_parallel_size" in flags]
    assert folded and all(flags["expert_tensor_parallel_size"] != flags["tensor_model_parallel_size"] and
                          flags["sequence_parallel"] == (flags["tensor_model_parallel_size"] > 1) and
                          "num_distributed_optimizer_instances" not in flags for flags in folded)
    for flags in folded:  # TP4 splits mixtral-tiny's 2 query groups, which validation refuses
        if flags["tensor_model_parallel_size"] < 4:
            make_config({**base, **flags}, 4)


def test_a_folded_layout_is_named_with_its_expert_tensor_parallel_size(capsys):
    flags = ["--model-preset", "mixtral-tiny", "--world-size", "4", "--global-batch-size", "8", "--json",
             "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]
    assert plan_layout_tool.main([*flags, "--expert-tensor-parallel-size", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"].startswith("tp2+sp cp1 pp1 vp1 dp2 ep2 etp1 no-ZeRO")
    assert plan_layout_tool.main([*flags, "--expert-tensor-parallel-size", "2"]) == 0  # ETP = TP: not named
    assert json.loads(capsys.readouterr().out)["layout"].startswith("tp2+sp cp1 pp1 vp1 dp2 ep2 no-ZeRO")


# fp32, 4 MoE layers of 4 experts, top-2, h 64, moe-ffn 96 (SwiGLU), s 32, micro-batch 1, global batch 8.
def _config(world_size: int, **flags):
    return make_config({**MOE, **flags}, world_size)


def test_expert_activations_follow_the_expert_region_and_the_expert_split():
    """Per token of the expert region and each of its k = 2 copies, the routed experts save e (3 h + 4 ffn / etp + 1)
    (input, SwiGLU's fc1 output, activation and product, output and its weighted copy, probability) and three int64
    indices; the router's tensors are on the rank's own tokens, alike for both. TP2 + SP: the region is the ETP
    group's s / 2 tokens each, 16 at ETP1 and 32 at ETP2; TP1 at ETP2: both ranks' 32 tokens, gathered."""
    e, h, ffn = 4, 64, 96

    def experts(region, etp):
        return region * 2 * (e * (3 * h + 4 * ffn // etp + 1) + 3 * 8)

    pairs = [(_config(4, **SP, expert_tensor_parallel_size=1, expert_model_parallel_size=2),
              _config(4, **SP, expert_model_parallel_size=2), experts(16, 1) - experts(32, 2)),
             (_config(4, expert_tensor_parallel_size=2, expert_model_parallel_size=2),
              _config(4, expert_model_parallel_size=2), experts(64, 2) - experts(32, 1))]
    for folded, unfolded, difference in pairs:
        assert layer_bytes(folded, MOE_LAYER) - layer_bytes(unfolded, MOE_LAYER) == difference
        assert layer_bytes(folded) == layer_bytes(unfolded)  # a dense layer does not see the experts' split


def _saved_bytes(module, x, skip) -> int:
    """Bytes of the distinct storages autograd saves in module(x), less those in `skip` (the parameters)."""
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(saved.values())


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("shared", [{}, {"moe_shared_expert_intermediate_size": 48},
                                    {"moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True},
                                    {"moe_latent_size": 24}, {"moe_latent_size": 24,
                                                              "moe_shared_expert_intermediate_size": 48}],
                         ids=["routed", "shared", "gated_shared", "latent", "latent_shared"])
def test_planned_moe_bytes_per_token_are_what_autograd_saves(shared, bf16):
    """One process: the MoE layer's saved tensors (its input, the norm's output, included) at two sequence lengths,
    whose difference cancels what does not grow with the tokens."""
    config = make_config({**MOE, **shared, "bf16": bf16, "num_layers": 1}, 1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = pretrain_gpt.model_provider(config, ParallelState.single(), model_chunk_plans(config, 0)[0],
                                        torch.device("cpu")).to(dtype)
    layer = next(module for module in model.modules() if isinstance(module, MoELayer))
    skip = {param.untyped_storage().data_ptr() for param in model.parameters()}
    measured = [_saved_bytes(layer, torch.randn(seq, 1, 64, dtype=dtype, requires_grad=True), skip)
                for seq in (16, 32)]
    assert (measured[1] - measured[0]) / 16 == moe_mlp_bytes(config) / config.model.seq_length


def test_folded_collectives_and_expert_gradients_are_timed_over_their_groups():
    """TP1 x DP4 with ETP2 x EP2: 2 micro-batches per rank, 4 MoE layers. Each MoE layer's MLP all-gathers and
    reduce-scatters the ETP pair's 64 tokens in forward and again in backward: 2 x 2 (2 - 1) / 2 x 64 h e bytes
    per layer and micro-batch; the all-to-all moves those 64 tokens' 2 copies 4 times, (2 - 1) / 2 of them, over
    ranks 4 apart (one node). Without sharding, gradients are all-reduced, 2 (d - 1) / d of 4 bytes each: dense
    over dp = 4, routed experts (4 / 2 per rank of each layer, fc1 [2 x 96 / 2, 64] and fc2 [64, 96 / 2]) over
    edp = 4 / (2 x 2) = 1 rank, so not at all; at ETP2 x EP1 over edp = 2."""
    hardware = Hardware()
    h, e, bandwidth = 64, 4, hardware.intra_node_bandwidth
    config = _config(4, expert_tensor_parallel_size=2, expert_model_parallel_size=2)
    state = stage_state_bytes(config, 0)
    assert state.expert_numel == 4 * 2 * (96 * 64 + 64 * 48)
    step = predict_step_time(config, "no_pipelining", state, hardware)
    assert step.tensor_parallel == pytest.approx(2 * 4 * 2 * (2 * 1 / 2) * 64 * h * e / bandwidth)
    assert step.expert_parallel == pytest.approx(4 * 2 * 4 * 64 * 2 * h * e * (1 / 2) / bandwidth)
    dense = state.numel - state.expert_numel
    assert data_parallel_bytes(config, state, hardware).intra_node == pytest.approx(2 * 3 / 4 * dense * 4)
    config = _config(4, expert_tensor_parallel_size=2)
    state = stage_state_bytes(config, 0)
    assert state.expert_numel == 4 * 4 * (96 * 64 + 64 * 48)
    assert data_parallel_bytes(config, state, hardware).intra_node == pytest.approx(
        2 * 3 / 4 * (state.numel - state.expert_numel) * 4 + 2 * 1 / 2 * state.expert_numel * 4)


def test_the_fast_enumeration_plans_what_planning_every_candidate_alone_plans():
    """Every candidate of mixtral-tiny on 4 ranks planned on its own, with no result shared between layouts, gives
    the reference; with the GPU's memory at the median of the layouts' largest state, the enumeration plans exactly
    the layouts whose state fits (same figures, same order) and counts the others (with the candidates it did not
    validate); with every layout asked for, it plans them all."""
    base = {"model_preset": "mixtral-tiny", "mock_data": True, "global_batch_size": 8, "bf16": True,
            "ddp_bucket_size": 20000}
    hardware, naive, refused = Hardware(), [], Counter()
    for flags in candidate_flags(base, 4, hardware.gpus_per_node, ("1f1b", "zb-h1")):
        try:
            naive.append(plan_layout(make_config({**base, **flags}, 4), 0, hardware, flags))
        except ConfigError as error:
            refused[str(error)] += 1
    naive.sort(key=lambda plan: plan.step_time.total)
    state = {id(plan): max(stage.state.total for stage in plan.stages) for plan in naive}
    memory = sorted(state.values())[len(naive) // 2]
    for plan in naive:
        plan.memory_bytes = memory
    found = enumerate_plans(base, 4, memory, hardware, ("1f1b", "zb-h1"))
    fitting_state = [plan for plan in naive if state[id(plan)] <= memory]
    assert 0 < len(fitting_state) < len(naive)
    assert [plan_record(plan) for plan in found.plans] == [plan_record(plan) for plan in fitting_state]
    # what the enumeration counts and does not validate, differing from a layout over memory only in recomputation
    # or schedule, is over memory too where valid, and otherwise one of the refusals it never met
    unmet = refused - found.refused
    assert found.over_in_state == len(naive) - len(fitting_state) + unmet.total() and not found.refused - refused
    assert any(plan.fits for plan in found.plans) and not all(plan.fits for plan in found.plans)
    every = enumerate_plans(base, 4, memory, hardware, ("1f1b", "zb-h1"), every_layout=True)
    assert [plan_record(plan) for plan in every.plans] == [plan_record(plan) for plan in naive]
