"""--num-distributed-optimizer-instances: ZeRO within groups of consecutive data-parallel ranks, gradient
shards all-reduced between them, trains as one process, and writes the checkpoint one instance would.

The groups are Megatron's (parallel_state.py): instance i is the slice [i s, (i + 1) s) of each dp x cp rank
list, s = dp x cp / N, and the inter-instance groups join the ranks at the same place of every slice (for
experts, the level-1 groups of create_hierarchical_groups(expert_dp, [edp / N, N])). At DP4 with N = 2 every
rank steps half the elements (a quarter at N = 1), losses, gradient norms (each element counted once, not
twice), weights and the optimizer state assembled from all ranks equal one process, for ZeRO-1 and ZeRO-3 at
DP4, ZeRO-1 for MoE at EP2 and ZeRO-2 with TP2 + SP at DP4. A checkpoint saved with N = 2 holds the tensors
of one saved with N = 1 and resumes at N = 1 and N = 4 as the uninterrupted run continues.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors
from megatron_lite.config.arguments import make_config
from megatron_lite.errors import ConfigError
from megatron_lite.model.sharding import FlatShard, unshard
from megatron_lite.parallel.state import Layout, group_ranks
from megatron_lite.planning.layouts import candidate_flags, plan_layout
from megatron_lite.planning.report import plan_lines
from megatron_lite.planning.state_memory import stage_state_bytes
from megatron_lite.planning.step_time import Hardware
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, gather_pieces, gathered_weights, train_steps, train_with_state
from tests.test_checkpoint_reshard import first_half, second_half, uninterrupted
from tests.test_distributed_optimizer import WEIGHT_TOLERANCE, assemble_state, assert_weights_close
from tests.test_moe_parallel import MOE as TINY_MOE
from tests.tolerances import assert_close_in_norm

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

VALUES = {**TINY_2_LAYERS, "train_iters": 5}
OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True}


def test_instances_are_consecutive_data_parallel_ranks_as_in_megatron():
    # TP2 x DP4: the dp ranks of TP rank 0 are 0, 2, 4, 6; two instances of two.
    layout = Layout(tp=2, dp=4, dist_opt_instances=2)
    assert sorted(group_ranks(layout, "intra_dp_cp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert sorted(group_ranks(layout, "inter_dist_opt")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # CP2 x DP4 x EP2, N = 2: dp_cp lists (cp fastest) [0..7] per TP rank 0; expert dp [0, 2, 4, 6], [1, 3, 5, 7].
    layout = Layout(cp=2, dp=4, ep=2, dist_opt_instances=2)
    assert sorted(group_ranks(layout, "intra_dp_cp")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert sorted(group_ranks(layout, "intra_expert_dp")) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # Megatron's level-1 groups of [0, 2, 4, 6] split [2, 2]: [0, 4], [2, 6]; of [1, 3, 5, 7]: [1, 5], [3, 7];
    # the same groups as the dense inter-instance ones, which therefore serve both.
    assert sorted(group_ranks(layout, "inter_dist_opt")) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # One instance: the inter-instance groups are single ranks (never created).
    assert group_ranks(Layout(dp=4), "inter_dist_opt") == [[0], [1], [2], [3]]


@pytest.mark.parametrize("values, message", [
    ({"num_distributed_optimizer_instances": 2},
     "--num-distributed-optimizer-instances acts only with --use-distributed-optimizer (or a "
     "--data-parallel-sharding-strategy other than no_shard); add that or drop --num-distributed-optimizer-instances"),
    ({"num_distributed_optimizer_instances": 3, "use_distributed_optimizer": True},
     "num-distributed-optimizer-instances (3) must divide data-parallel x context-parallel size (4 x 1 = 4)"),
    ({"num_distributed_optimizer_instances": 4, "use_distributed_optimizer": True, "model_preset": "mixtral-tiny",
      "num_experts": 4, "expert_model_parallel_size": 2},
     "num-distributed-optimizer-instances (4) must divide the expert data-parallel size (tensor x context x "
     "data-parallel / (expert-tensor x expert-model-parallel) = 2)"),
])
def test_impossible_instance_counts_are_one_line(values, message):
    with pytest.raises(ConfigError) as error:
        make_config({**VALUES, **values}, 4)
    assert str(error.value) == message


def train_and_describe(values: dict, world_size: int) -> dict:
    """As train_with_state, with the weights whole (gathered over TP) and the elements this rank steps."""
    model, optimizer, history = train_steps(values, world_size)
    tp_group = model[0].pstate.group("tp")
    specs = {name: p.spec for chunk in model for name, p in chunk.module.named_global_parameters()}
    state = {key: (value.data.clone(), value.flat_range, value.spec) if isinstance(value, FlatShard) else value
             for key, value in optimizer.sharded_state_dict().items()}
    return {"losses": [h["lm_loss"] for h in history], "norms": [h["grad_norm"] for h in history],
            "weights": {name: unshard(gather_pieces(w, tp_group), specs[name])
                        for name, w in gathered_weights(model).items()},
            "state": state, "tp": (model[0].pstate.tp_rank, model[0].pstate.tp_size),
            "stepped": sum(value[1][1] - value[1][0] for key, value in state.items() if ".exp_avg." in key)}


def _groups(values: dict, world_size: int) -> dict:
    from megatron_lite.training.loop import initialize

    pstate, _ = initialize(make_config(values, world_size))
    return {kind: dist.get_process_group_ranks(pstate.group(kind)) for kind in ("intra_dp_cp", "inter_dist_opt")}


DP4 = {"zero1": {**VALUES, "use_distributed_optimizer": True, "num_distributed_optimizer_instances": 2, **OVERLAP},
       "zero3": {**VALUES, "data_parallel_sharding_strategy": "optim_grads_params",
                 "num_distributed_optimizer_instances": 2, **OVERLAP},
       "zero1_n1": {**VALUES, "use_distributed_optimizer": True}}
# MoE at EP2: the expert dp size (2) split into two instances of one rank, expert shards whole, all-reduced
# over the dense inter-instance groups.
MOE = {**TINY_MOE, "train_iters": 5}
DP4["moe_ep2_zero1"] = {**MOE, "expert_model_parallel_size": 2, "use_distributed_optimizer": True,
                        "num_distributed_optimizer_instances": 2}
TP2_DP4 = {**VALUES, "tensor_model_parallel_size": 2, "sequence_parallel": True,
           "data_parallel_sharding_strategy": "optim_grads", "num_distributed_optimizer_instances": 2}


def _dp4_layouts() -> dict:
    return {"groups": _groups(DP4["zero1"], 4), **{name: train_and_describe(v, 4) for name, v in DP4.items()}}


def _tp2_dp4_layout() -> dict:
    return {"groups": _groups(TP2_DP4, 8), "zero2_tp2": train_and_describe(TP2_DP4, 8)}


def check_equals_one_process(runs: list[dict], reference: dict, weight_rel: float) -> None:
    """Losses and gradient norms to rel 1e-5, weights to `weight_rel` (L2 per parameter, as in
    test_distributed_optimizer), the optimizer state assembled from every rank's shards to rel 3e-5 (L2)."""
    for run in runs:
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert run["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        assert_weights_close(run["weights"], {name: reference["weights"][name] for name in run["weights"]},
                             weight_rel)  # with EP a rank holds its own experts
    assert set().union(*(run["weights"] for run in runs)) == reference["weights"].keys()
    state, expected = assemble_state(runs), assemble_state([reference])
    assert state.keys() == expected.keys()
    for key, tensor in state.items():
        assert_close_in_norm(tensor, expected[key], rel=3e-5, msg=key)


def test_two_instances_at_dp4_zero1_zero3_and_tp2_dp4_zero2_equal_one_process():
    reference = train_with_state(VALUES, 1)
    assert min(reference["norms"]) > VALUES["clip_grad"]  # clipping acts in every step: the norm matters
    dp4 = run_on_ranks(4, _dp4_layouts)
    assert [r["groups"] for r in dp4] == [{"intra_dp_cp": [0, 1], "inter_dist_opt": [0, 2]},
                                          {"intra_dp_cp": [0, 1], "inter_dist_opt": [1, 3]},
                                          {"intra_dp_cp": [2, 3], "inter_dist_opt": [0, 2]},
                                          {"intra_dp_cp": [2, 3], "inter_dist_opt": [1, 3]}]
    total = sum(t.numel() for t in reference["weights"].values())
    for name, strategy in (("zero1", "optim"), ("zero3", "optim_grads_params")):
        runs = [r[name] for r in dp4]
        check_equals_one_process(runs, reference, WEIGHT_TOLERANCE[strategy])
        # Sharded over the 2 ranks of an instance (plus bucket padding), not over all 4: rank r and r + 2 hold
        # the same shard.
        assert all(abs(r["stepped"] - total / 2) <= 4 for r in runs), name
        assert runs[0]["state"].keys() == runs[2]["state"].keys()
    assert all(abs(r["zero1_n1"]["stepped"] - total / 4) <= 4 for r in dp4)
    # EP2 permutes the tokens and sums the experts' outputs in another order than one process: after 5 Adam
    # steps the weights are 2e-6 apart (measured), beyond ZeRO-1's 1e-6 and within ZeRO-2/3's reordering bound.
    check_equals_one_process([r["moe_ep2_zero1"] for r in dp4], train_with_state(MOE, 1),
                             WEIGHT_TOLERANCE["optim_grads"])
    tp2 = run_on_ranks(8, _tp2_dp4_layout)
    assert tp2[0]["groups"] == {"intra_dp_cp": [0, 2], "inter_dist_opt": [0, 4]}
    assert tp2[7]["groups"] == {"intra_dp_cp": [5, 7], "inter_dist_opt": [3, 7]}
    check_equals_one_process([r["zero2_tp2"] for r in tp2], reference, WEIGHT_TOLERANCE["optim_grads"])


ZERO1 = {"use_distributed_optimizer": True}


def _save_at_n2_and_n1_then_resume_at_n1_and_n4(root: str) -> dict:
    return {"n2": first_half({**ZERO1, "num_distributed_optimizer_instances": 2}, f"{root}/n2", 4),
            "n1": first_half(ZERO1, f"{root}/n1", 4),
            "n2 -> n1": second_half(ZERO1, f"{root}/n2", 4),
            "n2 -> n4": second_half({**ZERO1, "num_distributed_optimizer_instances": 4}, f"{root}/n2", 4)}


def test_a_checkpoint_saved_with_two_instances_holds_one_instance_tensors_and_resumes_at_one_and_four(tmp_path):
    reference = uninterrupted()
    runs = run_on_ranks(4, _save_at_n2_and_n1_then_resume_at_n1_and_n4, str(tmp_path))[-1]
    assert runs["n2"] == pytest.approx(reference[:5], rel=1e-5)
    for name in ("n2 -> n1", "n2 -> n4"):
        assert len(runs[name]) == 5 and runs[name] == pytest.approx(reference[5:], rel=1e-5), name
    saved, plain = (read_checkpoint_tensors(f"{tmp_path}/{n}/iter_0000005") for n in ("n2", "n1"))
    assert saved.keys() == plain.keys()
    assert any(key.startswith("optimizer.state.exp_avg_sq.") for key in saved)
    for key, tensor in saved.items():
        assert tensor.shape == plain[key].shape, key
        if tensor.is_floating_point():
            assert_close_in_norm(tensor.double(), plain[key].double(), rel=1e-5, msg=key)
        else:
            assert torch.equal(tensor, plain[key]), key


# ---------------------------------------------------------------------------------------------------------
# The planner

LLAMA_8B = {"model_preset": "llama3-8b", "mock_data": True, "global_batch_size": 64, "bf16": True}


def test_the_planner_counts_intra_and_inter_node_bytes_of_each_instance_count():
    # 16 ranks on two nodes of 8, DP16. A ring reduce-scatter or all-gather over g ranks sends (g - 1) / g of
    # the buffer, an all-reduce twice that. One instance: the fp32 gradients reduce-scattered and the bf16
    # weights gathered over all 16 ranks, across the nodes. Two: over the 8 ranks of a node, then the rank's
    # 1/8 shard of fp32 gradients all-reduced with its peer on the other node.
    hardware = Hardware(gpus_per_node=8)
    traffic = {}
    for strategy, instances in (("optim", 1), ("optim", 2), ("optim_grads_params", 2)):
        config = make_config({**LLAMA_8B, "data_parallel_sharding_strategy": strategy,
                              "num_distributed_optimizer_instances": instances}, 16)
        plan = plan_layout(config, 80 * 2**30, hardware)
        traffic[strategy, instances] = plan
    n = stage_state_bytes(make_config(LLAMA_8B, 16), 0).numel
    m = 64 // 16  # micro-batches per rank
    one, two, zero3 = (traffic[k].data_parallel_bytes for k in (("optim", 1), ("optim", 2), ("optim_grads_params", 2)))
    assert (one.intra_node, one.inter_node) == pytest.approx((0, 15 / 16 * n * (4 + 2)))
    assert (two.intra_node, two.inter_node) == pytest.approx((7 / 8 * n * (4 + 2), 2 * (1 / 2) * n / 8 * 4))
    # ZeRO-3 reduce-scatters every micro-batch and gathers in forward and backward; the shard crosses once.
    assert (zero3.intra_node, zero3.inter_node) == pytest.approx((7 / 8 * n * (4 * m + 2 * 2 * m), n / 8 * 4))
    for plan in traffic.values():
        expected = (plan.data_parallel_bytes.intra_node / hardware.intra_node_bandwidth
                    + plan.data_parallel_bytes.inter_node / hardware.inter_node_bandwidth)
        assert plan.step_time.data_parallel == pytest.approx(expected)
    # Sharded over 8 instead of 16 ranks: twice the optimizer state (masters and moments, 12 bytes per element).
    assert traffic["optim", 2].largest.state.optimizer == pytest.approx(12 * n / 8, rel=1e-6)
    assert traffic["optim", 1].largest.state.optimizer == pytest.approx(12 * n / 16, rel=1e-6)


def test_the_planner_enumerates_every_instance_count_of_the_sharded_strategies():
    seen = {}
    for flags in candidate_flags({"model_preset": "llama-tiny"}, 16, 8, ("1f1b",)):
        if flags["tensor_model_parallel_size"] == flags["context_parallel_size"] == 1 and \
                flags["pipeline_model_parallel_size"] == 1:
            seen.setdefault(flags["data_parallel_sharding_strategy"], set()).add(
                flags.get("num_distributed_optimizer_instances", 1))
    assert seen == {"no_shard": {1}, **{s: {1, 2, 4, 8, 16} for s in ("optim", "optim_grads", "optim_grads_params")}}
    lines = plan_lines(plan_layout(make_config({**LLAMA_8B, "use_distributed_optimizer": True,
                                                "num_distributed_optimizer_instances": 2}, 16), 0, Hardware()))
    assert "ZeRO-1 instances=2" in lines[0] and "GiB across nodes" in lines[-1]
