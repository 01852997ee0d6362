"""How close the layout planner's per-rank bytes are to what real multi-rank CPU runs allocate.

For each layout (Llama-style shapes, one with multi-token prediction, one MoE shape for the layouts with expert
parallelism and folding; 4 gloo ranks of the test harness) every
rank builds the model and optimizer and runs one training step to warm up; then
  - parameters, gradients and optimizer state: the bytes the built objects hold
    (DistributedDataParallel.memory_footprint, Optimizer.memory_footprint), against
    planning.state_memory.stage_state_bytes;
  - peak activations: the CPU allocator's own running total while the schedule runs one more global batch
    (torch.profiler with profile_memory: every allocation and free of the CPU allocator made while profiling,
    so the peak is what the forward and backward passes allocated on top of what existed before them),
    against planning.activation_memory.stage_activation_bytes.
Prints the largest relative error per layout and appends everything to benchmarks/results/plan_accuracy.jsonl.
Under zb-h1 the table also shows every stage's measured and planned peak: stages differ in how many weight
gradient passes wait at once.

    python -m benchmarks.plan_accuracy [--shapes NAME ...] [--layouts NAME ...]
"""

from __future__ import annotations

import argparse
import sys

import pretrain_gpt
from benchmarks.cpu_allocation_peak import measure_peak
from benchmarks.results_file import record_result
from megatron_lite.config.arguments import make_config
from megatron_lite.planning.activation_memory import stage_activation_bytes
from megatron_lite.planning.layouts import schedule_of
from megatron_lite.planning.state_memory import stage_state_bytes
from megatron_lite.training.loop import (
    build_data_iterator,
    build_datasets,
    get_schedule,
    initialize,
    setup_model_and_optimizer,
    train_step,
)
from tests.harness import run_on_ranks

SHAPES = {
    "llama_fp32_untied": {"model_preset": "llama-tiny", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 192,
                          "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 512, "seq_length": 256,
                          "max_position_embeddings": 256},
    "llama_bf16_tied": {"model_preset": "llama-tiny", "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 352,
                        "num_attention_heads": 8, "num_query_groups": 4, "vocab_size": 1000, "seq_length": 256,
                        "max_position_embeddings": 256, "untie_embeddings_and_output_weights": False, "bf16": True},
    "llama_fp32_untied_mtp2": {"model_preset": "llama-tiny", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 192,
                               "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 512, "seq_length": 256,
                               "max_position_embeddings": 256, "mtp_num_layers": 2},
    "mixtral_fp32_moe": {"model_preset": "mixtral-tiny", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 192,
                         "moe_ffn_hidden_size": 96, "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 512,
                         "seq_length": 256, "max_position_embeddings": 256, "num_experts": 4, "moe_router_topk": 2},
}
RUN = {"mock_data": True, "micro_batch_size": 2, "train_iters": 3, "eval_interval": 1000, "log_interval": 1000}
LAYOUTS = {
    "dp4": {"global_batch_size": 8},
    "tp2_dp2": {"tensor_model_parallel_size": 2, "global_batch_size": 8},
    "tp2_sp_dp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "global_batch_size": 8},
    "pp2_dp2_1f1b_m4": {"pipeline_model_parallel_size": 2, "global_batch_size": 16},
    "pp4_1f1b_m4": {"pipeline_model_parallel_size": 4, "global_batch_size": 8},
    "pp2_dp2_zb-h1_m4": {"pipeline_model_parallel_size": 2, "pipeline_schedule": "zb-h1", "global_batch_size": 16},
    "pp4_zb-h1_m4": {"pipeline_model_parallel_size": 4, "pipeline_schedule": "zb-h1", "global_batch_size": 8},
    "pp2_vp2_dp2_m4": {"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
                       "global_batch_size": 16},
    "cp2_dp2": {"context_parallel_size": 2, "global_batch_size": 8},
    "tp2_pp2_m4": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "global_batch_size": 8},
    "dp4_zero1": {"use_distributed_optimizer": True, "global_batch_size": 8},
    "dp4_recompute_full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
                           "global_batch_size": 8},
    "dp4_recompute_selective": {"recompute_granularity": "selective", "global_batch_size": 8},
    "pp2_dp2_zero1_recompute_full": {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True,
                                     "recompute_granularity": "full", "recompute_method": "uniform",
                                     "recompute_num_layers": 1, "global_batch_size": 16},
    "dp4_zero2": {"data_parallel_sharding_strategy": "optim_grads", "global_batch_size": 8},
    "dp4_zero3": {"data_parallel_sharding_strategy": "optim_grads_params", "global_batch_size": 8},
    "pp2_dp2_zero3_small_buckets": {"pipeline_model_parallel_size": 2,
                                    "data_parallel_sharding_strategy": "optim_grads_params", "ddp_bucket_size": 20000,
                                    "global_batch_size": 16},
    # MoE shapes only (expert flags): EP, and MoE parallel folding (--expert-tensor-parallel-size)
    "dp4_ep2": {"expert_model_parallel_size": 2, "global_batch_size": 8},
    "tp2_sp_dp2_ep2": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                       "global_batch_size": 8},
    "tp2_sp_dp2_etp1_ep2": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                            "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 2, "global_batch_size": 8},
    "tp1_dp4_etp2_ep2": {"expert_tensor_parallel_size": 2, "expert_model_parallel_size": 2, "global_batch_size": 8},
}
EXPERT_FLAGS = ("expert_model_parallel_size", "expert_tensor_parallel_size")


def measure(values: dict, world_size: int) -> dict:
    """On this rank: built and planned state bytes, measured and planned peak activation bytes."""
    config = make_config(values, world_size)
    pstate, device = initialize(config)
    model, optimizer = setup_model_and_optimizer(config, pstate, pretrain_gpt.model_provider, device)
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    train_step(pretrain_gpt.forward_step, iterator, model, optimizer, config, pstate, 0, device)
    built = {"params": 0, "grads": 0, "optimizer": sum(optimizer.memory_footprint().values())}
    for chunk in model:
        for kind, size in chunk.memory_footprint().items():
            built[kind] += size
    for chunk in model:
        chunk.zero_grad_buffer()

    def forward_backward():
        get_schedule(config)(pretrain_gpt.forward_step, iterator, model, config.num_microbatches, pstate=pstate,
                             config=config, loss_scale=optimizer.loss_scale)

    measured_peak, unrecorded_frees = measure_peak(forward_backward)
    state = stage_state_bytes(config, pstate.pp_rank, pstate.cp_rank + pstate.cp_size * pstate.dp_rank,
                              tp_rank=pstate.tp_rank)
    activations = stage_activation_bytes(config, pstate.pp_rank, schedule_of(config))
    return {"pp_rank": pstate.pp_rank, "built": built,
            "planned": {"params": state.params, "grads": state.grads, "optimizer": state.optimizer},
            "activation_peak": {"measured": measured_peak, "planned": activations.peak,
                                "unrecorded_frees": unrecorded_frees}}


def relative_error(planned: int, measured: int) -> float:
    return abs(planned - measured) / measured if measured else float(planned != 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), metavar="NAME",
                        help=f"model shapes to run, of {', '.join(SHAPES)}")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), metavar="NAME",
                        help=f"layouts to run, of {', '.join(LAYOUTS)}")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'shape':<20} {'layout':<30} {'state err':>10} {'act err':>8} {'act MiB meas/plan (worst rank)':>32}")
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for layout_name in args.layouts:
            layout = LAYOUTS[layout_name]
            if any(flag in layout for flag in EXPERT_FLAGS) and not shape.get("num_experts"):
                continue
            ranks = run_on_ranks(4, measure, {**shape, **RUN, **layout}, 4)
            state_error = max(relative_error(r["planned"][k], r["built"][k]) for r in ranks for k in r["built"])
            worst = max(ranks, key=lambda r: relative_error(r["activation_peak"]["planned"],
                                                            r["activation_peak"]["measured"]))
            act = worst["activation_peak"]
            act_error = relative_error(act["planned"], act["measured"])
            print(f"{shape_name:<20} {layout_name:<30} {state_error:>10.2e} {act_error:>8.3f} "
                  f"{act['measured'] / 2**20:>15.2f}/{act['planned'] / 2**20:.2f}", flush=True)
            if layout.get("pipeline_schedule") == "zb-h1":
                stages = {r["pp_rank"]: r["activation_peak"] for r in ranks}
                print("    per stage, MiB measured/planned: " + ", ".join(
                    f"stage {p} {peak['measured'] / 2**20:.2f}/{peak['planned'] / 2**20:.2f}"
                    for p, peak in sorted(stages.items())), flush=True)
            rows.append({"shape": shape_name, "layout": layout_name, "flags": layout, "ranks": ranks,
                         "state_max_relative_error": state_error, "activation_max_relative_error": act_error})
    worst_state = max(row["state_max_relative_error"] for row in rows)
    worst_act = max(row["activation_max_relative_error"] for row in rows)
    print(f"worst: parameters/gradients/optimizer {worst_state:.2e}, peak activations {worst_act:.3f} "
          f"({len(rows)} layouts x 4 ranks)")
    record_result("plan_accuracy", {"shapes": {name: SHAPES[name] for name in args.shapes}, "run": RUN,
                                    "layouts": rows,
                                    "worst_state_relative_error": worst_state,
                                    "worst_activation_relative_error": worst_act}, sys.argv)


if __name__ == "__main__":
    main()
