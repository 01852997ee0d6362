"""The layout planner: its parameter, gradient and optimizer bytes are those the built model and optimizer
allocate on every rank (tiny models in 4-rank worlds: TP+SP, PP with tied and untied embeddings, virtual
stages, MoE with EP, every ZeRO stage, two distributed-optimizer instances, small buckets so that padding shows,
optimizer state offloaded to the host); a layout that cannot fit is
refused naming the rank and the bytes over; --json lists valid layouts fastest first. Under zb-h1 the gradients a
waiting weight-gradient pass holds, and how many passes wait at once, are those of a real run on every stage."""

from __future__ import annotations

import json

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_split import model_chunk_plans, pipeline_stage_layers
from megatron_lite.pipeline import split_backward
from megatron_lite.pipeline.microbatch import ScheduleStats
from megatron_lite.planning.activation_memory import waiting_weight_passes, weight_pass_bytes
from megatron_lite.planning.layouts import candidate_flags, offload_fraction_of, pipeline_split
from megatron_lite.planning.state_memory import stage_state_bytes
from megatron_lite.training.loop import build_data_iterator, build_datasets, get_schedule
from tests.harness import run_on_ranks
from tests.helpers import build_run
from tools import plan_layout

LLAMA = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96,
         "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 250, "seq_length": 32,
         "max_position_embeddings": 32, "micro_batch_size": 1, "global_batch_size": 8}
GPT = {**LLAMA, "model_preset": "gpt2-124m", "num_query_groups": None, "untie_embeddings_and_output_weights": False}
LAYOUTS = {
    "tp2_sp_dp2_zero1_bf16_small_buckets": {**LLAMA, "tensor_model_parallel_size": 2, "sequence_parallel": True,
                                           "use_distributed_optimizer": True, "bf16": True,
                                           "ddp_bucket_size": 5000},
    "pp2_dp2_tied_gpt_no_shard_fp32": {**GPT, "pipeline_model_parallel_size": 2},
    "pp2_vp2_dp2_zero3_bf16": {**LLAMA, "pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
                               "data_parallel_sharding_strategy": "optim_grads_params", "bf16": True,
                               "ddp_bucket_size": 3000},
    "dp4_ep2_moe_zero2_bf16": {**LLAMA, "model_preset": "mixtral-tiny", "num_experts": 4,
                               "expert_model_parallel_size": 2, "data_parallel_sharding_strategy": "optim_grads",
                               "bf16": True, "ddp_bucket_size": 7000},
    "tp2_dp2_ep2_moe_shared_expert_zero1": {**LLAMA, "model_preset": "mixtral-tiny", "num_experts": 4,
                                            "expert_model_parallel_size": 2, "tensor_model_parallel_size": 2,
                                            "moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True,
                                            "use_distributed_optimizer": True},
    "tp2_dp2_qk_norm_qkv_bias_zero2_fp32": {**LLAMA, "tensor_model_parallel_size": 2, "qk_layernorm": True,
                                            "add_qkv_bias": True, "data_parallel_sharding_strategy": "optim_grads"},
    "tp2_dp2_zero1_bf16_offload_0.3": {**LLAMA, "tensor_model_parallel_size": 2, "use_distributed_optimizer": True,
                                       "bf16": True, "ddp_bucket_size": 4000, "optimizer_cpu_offload": True,
                                       "optimizer_offload_fraction": 0.3},
    "dp4_two_instances_zero3_bf16": {**LLAMA, "data_parallel_sharding_strategy": "optim_grads_params",
                                     "num_distributed_optimizer_instances": 2, "bf16": True, "ddp_bucket_size": 3000},
    "dp4_ep2_moe_two_instances_zero1": {**LLAMA, "model_preset": "mixtral-tiny", "num_experts": 4,
                                        "expert_model_parallel_size": 2, "use_distributed_optimizer": True,
                                        "num_distributed_optimizer_instances": 2, "ddp_bucket_size": 7000},
    "pp2_vp2_dp2_no_shard_fp32_offload_0.6": {**LLAMA, "pipeline_model_parallel_size": 2,
                                              "num_virtual_stages_per_pipeline_rank": 2, "optimizer_cpu_offload": True,
                                              "optimizer_offload_fraction": 0.6},
}


def built_and_planned(values: dict, world_size: int) -> dict:
    """This rank's allocated bytes of parameters, gradients and optimizer state, beside the planner's."""
    config, pstate, _, model, optimizer = build_run(values, world_size)
    held = {"params": 0, "grads": 0}
    for chunk in model:
        for kind, size in chunk.memory_footprint().items():
            held[kind] += size
    held["optimizer"] = sum(optimizer.memory_footprint().values())
    held["optimizer_on_host"] = sum(optimizer.host_memory_footprint().values())
    planned = stage_state_bytes(config, pstate.pp_rank, pstate.cp_rank + pstate.cp_size * pstate.dp_rank,
                                offload_fraction_of(config), tp_rank=pstate.tp_rank)
    return {"built": held, "planned": {"params": planned.params, "grads": planned.grads,
                                       "optimizer": planned.optimizer, "optimizer_on_host": planned.optimizer_on_host}}


@pytest.mark.parametrize("name", LAYOUTS)
def test_planned_state_bytes_equal_the_built_model_on_every_rank(name):
    results = run_on_ranks(4, built_and_planned, LAYOUTS[name], 4)
    for rank, result in enumerate(results):
        assert result["planned"] == result["built"], f"rank {rank}"
    if "offload" in name:  # whole ranges on the host, on every rank, and not all of them
        assert all(result["built"]["optimizer_on_host"] > 0 and result["built"]["optimizer"] for result in results)


def test_a_layout_that_cannot_fit_is_refused_with_the_rank_and_bytes_over(capsys):
    # Llama-3 8B unsharded in bf16: 8.03e9 parameters x (2 weight + 4 grad + 12 optimizer) bytes on every rank.
    flags = ["--model-preset", "llama3-8b", "--world-size", "8", "--global-batch-size", "8", "--bf16",
             "--tensor-model-parallel-size", "1", "--gpu-memory-gib", "80"]
    assert plan_layout.main(flags) == 1
    message = capsys.readouterr().err.strip()
    assert message.startswith("plan_layout.py: layout tp1 cp1 pp1 vp1 dp8 no-ZeRO")
    assert "rank 0 (pipeline stage 0)" in message
    over = int(message.split("over by ")[1].split(" bytes")[0].replace(",", ""))
    assert over >= 8.03e9 * 18 - 80 * 2**30
    assert plan_layout.main([*flags, "--json"]) == 1
    record = json.loads(capsys.readouterr().out)
    assert record["over_by_bytes"] == over == record["max_rank_bytes"] - 80 * 2**30
    assert plan_layout.main([*flags[:-2], "--gpu-memory-gib", str(record["max_rank_bytes"] / 2**30)]) == 0


def test_no_fitting_layout_is_one_line_naming_the_smallest_world_size_with_one(capsys):
    flags = ["--model-preset", "llama-tiny", "--global-batch-size", "8", "--top", "0", "--json"]
    smallest = {}
    for world_size in (1, 2, 4):
        assert plan_layout.main([*flags, "--world-size", str(world_size), "--gpu-memory-gib", "1000"]) == 0
        layouts = json.loads(capsys.readouterr().out)["layouts"]
        smallest[world_size] = min(layout["max_rank_bytes"] for layout in layouts)
    assert smallest[4] < smallest[2] < smallest[1]
    between = (smallest[2] + smallest[1]) / 2 / 2**30  # fits on two ranks, not on one
    for tail in ([], ["--json"]):
        assert plan_layout.main([*flags[:-3], "--world-size", "1", "--gpu-memory-gib", str(between), *tail]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err == (f"plan_layout.py: error: no layout of 1 rank fits in {between:g} GiB per rank; the "
                                f"smallest power-of-two multiple of it with one is --world-size 2\n")


def test_json_lists_valid_layouts_fastest_first(capsys):
    assert plan_layout.main(["--model-preset", "llama-tiny", "--world-size", "4", "--global-batch-size", "8",
                             "--gpu-memory-gib", "0.01", "--top", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    layouts = out["layouts"]
    times = [layout["step_time_s"] for layout in layouts]
    assert times == sorted(times) and len(layouts) > 20
    assert {layout["fits"] for layout in layouts} == {True, False}
    for layout in layouts:
        make_config({"model_preset": "llama-tiny", "mock_data": True, "global_batch_size": 8, **layout["flags"]}, 4)
        assert layout["max_rank_bytes"] == max(stage["total_bytes"] for stage in layout["stages"])
        assert layout["fits"] == (layout["max_rank_bytes"] <= out["gpu_memory_bytes"])
        for stage in layout["stages"]:
            assert stage["total_bytes"] == (stage["params_bytes"] + stage["grads_bytes"] + stage["optimizer_bytes"]
                                            + stage["activation_peak_bytes"])


def test_the_schedule_and_the_offloaded_share_are_read_from_the_flags(capsys):
    # PP2 x DP2 with 8 micro-batches per rank: GPipe holds all 8, 1F1B P - p (2 on stage 0, 1 on stage 1),
    # ZB-H1 P on every stage (graphs wait for their weight-gradient pass).
    flags = ["--model-preset", "llama-tiny", "--world-size", "4", "--global-batch-size", "16", "--json",
             "--pipeline-model-parallel-size", "2"]
    records = {}
    for schedule in ("1f1b", "gpipe", "zb-h1"):
        assert plan_layout.main([*flags, "--pipeline-schedule", schedule]) == 0
        records[schedule] = json.loads(capsys.readouterr().out)
        assert records[schedule]["schedule"] == schedule
    in_flight = {name: [stage["microbatches_in_flight"] for stage in record["stages"]]
                 for name, record in records.items()}
    assert in_flight == {"1f1b": [2, 1], "gpipe": [8, 8], "zb-h1": [2, 2]}
    # Idle time of the first stage with P = 2 stages and m = 8 micro-batches, from per-pass times: a backward
    # costs two forwards, split evenly into the input-gradient (B) and the weight-gradient (W) pass, so each of
    # F, B and W is a third of a micro-batch's compute. 1F1B and GPipe wait (P - 1)(t_F + t_B + t_W); ZB-H1
    # fills t_W of each of those slots with deferred weight-gradient passes.
    stages, microbatches = 2, 8
    for name, record in records.items():
        t_f = t_b = t_w = record["step_time"]["compute"] / (3 * microbatches)
        idle = (t_f + t_b - t_w) if name == "zb-h1" else (t_f + t_b + t_w)
        assert record["step_time"]["bubble"] == pytest.approx((stages - 1) * idle)
    assert plan_layout.main([*flags, "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.25"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["offload_fraction"] == 0.25
    # fp32 weights: an element stepped on the device costs its two moments (8 bytes); on the host its master,
    # moments and gradient buffer (16 bytes).
    for stage, plain in zip(record["stages"], records["1f1b"]["stages"]):
        moved = (plain["optimizer_bytes"] - stage["optimizer_bytes"]) // 8
        assert stage["optimizer_host_bytes"] == 16 * moved and 0 < moved < plain["optimizer_bytes"] // 8


def test_a_given_schedule_applies_to_pipelined_layouts_only_and_a_flag_every_layout_breaks_is_named(capsys):
    flags = ["--model-preset", "llama-tiny", "--world-size", "4", "--global-batch-size", "8", "--top", "0", "--json"]
    names = {}
    for schedule in ("1f1b", "gpipe"):
        assert plan_layout.main([*flags, "--pipeline-schedule", schedule]) == 0
        names[schedule] = [layout["layout"].replace(" gpipe", " 1f1b")
                           for layout in json.loads(capsys.readouterr().out)["layouts"]]
    assert sorted(names["gpipe"]) == sorted(names["1f1b"])
    assert any(" pp1 " in name for name in names["gpipe"]) and any(" vp2 " in name for name in names["gpipe"])
    assert plan_layout.main([*flags, "--optimizer-offload-fraction", "0.5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "plan_layout.py: error: --optimizer-offload-fraction acts only with --optimizer-cpu-offload; add that or "
        "drop --optimizer-offload-fraction")


ZB_H1_LAYOUTS = {
    "pp4_llama_bf16_m4": {**LLAMA, "pipeline_model_parallel_size": 4, "pipeline_schedule": "zb-h1", "bf16": True,
                          "global_batch_size": 4},
    "pp4_llama_fp32_m2": {**LLAMA, "pipeline_model_parallel_size": 4, "pipeline_schedule": "zb-h1",
                          "global_batch_size": 2},
    "tp2_sp_pp2_gpt_biases_qk_norm_m4": {**GPT, "tensor_model_parallel_size": 2, "sequence_parallel": True,
                                         "pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1",
                                         "qk_layernorm": True, "global_batch_size": 4},
    "pp2_ep2_moe_shared_expert_bf16_m4": {**LLAMA, "model_preset": "mixtral-tiny", "num_experts": 4,
                                          "expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                          "pipeline_schedule": "zb-h1", "moe_shared_expert_intermediate_size": 64,
                                          "moe_shared_expert_gate": True, "bf16": True},
}


def weight_passes_held_and_planned(values: dict, world_size: int) -> dict:
    """One zb-h1 step on this rank: the bytes of the gradients each W pass holds while it waits (distinct
    storages), the most W passes waiting at once (from the timeline), and the planner's figures for both."""
    config, pstate, _, model, optimizer = build_run(values, world_size)
    held = []
    backward_input = split_backward.backward_input

    def recording(*args):
        input_grad, weight_pass = backward_input(*args)
        storages = {grad.untyped_storage().data_ptr(): grad.untyped_storage().nbytes()
                    for _, grads, _ in weight_pass.calls for grad in grads}
        held.append(sum(storages.values()))
        return input_grad, weight_pass

    stats = ScheduleStats()
    split_backward.backward_input = recording
    try:
        iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
        get_schedule(config)(pretrain_gpt.forward_step, iterator, model, config.num_microbatches, pstate=pstate,
                             config=config, loss_scale=optimizer.loss_scale, stats=stats)
    finally:
        split_backward.backward_input = backward_input
    waiting = most_waiting = 0
    for kind, *_ in stats.events:
        waiting += {"B": 1, "W": -1}.get(kind, 0)
        most_waiting = max(most_waiting, waiting)
    pp = config.parallel.pipeline_model_parallel_size
    return {"held": held, "most_waiting": most_waiting,
            "planned": weight_pass_bytes(config, model_chunk_plans(config, pstate.pp_rank)[0]),
            "planned_waiting": waiting_weight_passes(pp, pstate.pp_rank, config.num_microbatches)}


@pytest.mark.parametrize("name", ZB_H1_LAYOUTS)
def test_zb_h1_plans_the_gradients_waiting_weight_passes_hold_on_every_stage(name):
    results = run_on_ranks(4, weight_passes_held_and_planned, ZB_H1_LAYOUTS[name], 4)
    for rank, result in enumerate(results):
        assert result["held"] and set(result["held"]) == {result["planned"]}, f"rank {rank}"
        assert result["most_waiting"] == result["planned_waiting"], f"rank {rank}"


def test_zb_h1_weight_pass_bytes_by_hand():
    # Llama fp32, 4 layers on PP2 (2 per stage), s = 32, b = 1: 32 tokens. Per layer: two RMSNorm output
    # gradients in fp32 (2 x 32 x 64 x 4), and the grad_output of QKV ((4 + 2 x 2) x 16 = 128 wide), of the
    # output projection (64), of fc1 (2 x 96 for SwiGLU) and of fc2 (64), 4 bytes each. The last stage adds the
    # final norm's (32 x 64 x 4) and the output layer's (vocabulary 250 padded to 256). The first stage holds
    # the gradient it received, [32, 1, 64] in fp32.
    config = make_config({**LLAMA, "pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1"}, 2)
    layer = 2 * 32 * 64 * 4 + 32 * 4 * (128 + 64 + 192 + 64)
    first, last = (weight_pass_bytes(config, model_chunk_plans(config, p)[0]) for p in (0, 1))
    assert first == 32 * 64 * 4
    assert last == 2 * layer + 32 * 64 * 4 + 32 * 256 * 4


def test_a_layer_count_that_does_not_divide_is_planned_with_megatrons_first_and_last_stage_flags():
    """61 layers (DeepSeek-V3) over 16 stages: 14 middle stages of ceil(61/16) = 4 layers, the 5 left over on
    the first (3) and last (2) stages, as --decoder-first/last-pipeline-num-layers give them."""
    split = pipeline_split(61, 16, 1)
    assert split == {"decoder_first_pipeline_num_layers": 3, "decoder_last_pipeline_num_layers": 2}
    config = make_config({**LLAMA, "num_layers": 61, "global_batch_size": 16, "pipeline_model_parallel_size": 16,
                          **split}, 16)
    assert pipeline_stage_layers(config) == [3] + [4] * 14 + [2]
    assert pipeline_split(64, 16, 1) == {}  # even: no flags
    assert pipeline_split(61, 32, 1) is None  # 30 middle stages of 2 leave one layer for two stages
    assert pipeline_split(5, 2, 2) is None  # virtual stages split evenly or not at all


def test_the_candidates_of_a_moe_preset_include_expert_parallelism_and_uneven_pipelines():
    """The preset names the experts (mixtral-tiny: 8) and layers (4), not the flags given."""
    base = {"model_preset": "mixtral-tiny", "mock_data": True, "num_layers": 3}
    candidates = list(candidate_flags(base, 4, 8, ("1f1b",)))
    assert {flags.get("expert_model_parallel_size", 1) for flags in candidates} == {1, 2, 4}
    pipelined = [flags for flags in candidates if flags["pipeline_model_parallel_size"] == 2]
    assert pipelined and all(flags.get("decoder_first_pipeline_num_layers") == 2 and
                             flags.get("decoder_last_pipeline_num_layers") == 1 for flags in pipelined)
    assert all(flags["pipeline_model_parallel_size"] <= 3 for flags in candidates)
