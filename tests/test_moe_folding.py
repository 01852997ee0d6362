"""MoE parallel folding (--expert-tensor-parallel-size): experts laid out independently of attention's tensor
parallelism train exactly as one process holding every expert.

The coordinates: a stage's flat index tp + TP (cp + CP dp) read as etp-ep-edp, checked against tables written
out by hand and, with ETP = TP, against the unfolded layout's own definition (ep and edp split dp x cp).

On one 4-rank world: TP2 x PP2 with the experts at ETP1 x EP2 (TP2 x EP2 at DP1), TP2 x DP2 at ETP1 x EP4, TP1 x DP4
and CP2 x DP2 at ETP2 x EP2 (experts split over ranks that hold different tokens), and TP2 x DP2 at ETP1 x EP2 (two
expert replicas) with a gated shared expert, sigmoid routing with an expert bias and the distributed optimizer (for
the gradients, without): the losses, gradient norms and MoE metrics of 4 steps and the first step's gradients of
every router, expert and shared-expert weight equal one process; with a capacity factor the same token copies are
dropped.
A checkpoint saved folded resumes unfolded (ETP = TP) and on one process, and the losses continue as the
uninterrupted run's.
Muon (which orthogonalises each expert whole, gathered over its expert-tensor-parallel shards) at TP1 x DP4 with
ETP2 x EP2, and at TP2 x DP2 with ETP1 under --muon-tp-mode distributed, trains as one process.
"""

from __future__ import annotations

import pytest

from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.model.sharding import unshard
from megatron_lite.parallel.state import Layout, group_ranks, rank_coordinates
from tests.harness import run_on_ranks
from tests.helpers import pretrain_keeping_chunks
from tests.tolerances import assert_close_relative

MOE = {
    "model_preset": "mixtral-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
    "moe_ffn_hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 256,
    "num_experts": 4, "moe_router_topk": 2, "moe_layer_freq": 1, "moe_aux_loss_coeff": 0.01,
    "moe_z_loss_coeff": 0.001, "seq_length": 32, "max_position_embeddings": 32, "micro_batch_size": 2,
    "global_batch_size": 8, "train_iters": 4, "lr": 3e-3, "lr_warmup_iters": 1, "eval_interval": 1000,
    "log_interval": 1,
}
MODERN = {**MOE, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
          "moe_router_bias_update_rate": 0.002, "moe_shared_expert_intermediate_size": 32,
          "moe_shared_expert_gate": True, "use_distributed_optimizer": True}
CAPACITY = {**MOE, "moe_expert_capacity_factor": 1.0}
MUON = {**MOE, "optimizer": "muon", "lr": 1e-2}
ONE_STEP = {"train_iters": 1, "lr_warmup_iters": 0, "use_distributed_optimizer": False}  # whole gradients

SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
LAYOUTS = {  # name: (model, flags), on 4 ranks
    "tp2_pp2_etp1_ep2": (MOE, {**SP, "pipeline_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
                               "expert_model_parallel_size": 2}),
    "tp2_dp2_etp1_ep4": (MOE, {**SP, "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 4}),
    "tp1_dp4_etp2_ep2": (MOE, {"expert_tensor_parallel_size": 2, "expert_model_parallel_size": 2}),
    "tp1_cp2_dp2_etp2_ep2": (MOE, {"context_parallel_size": 2, "expert_tensor_parallel_size": 2,
                                   "expert_model_parallel_size": 2}),
    "modern_tp2_dp2_etp1_ep2": (MODERN, {**SP, "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 2}),
    "capacity_tp2_dp2_etp1_ep4": (CAPACITY, {**SP, "expert_tensor_parallel_size": 1,
                                             "expert_model_parallel_size": 4}),
    "capacity_tp1_dp4_etp2_ep2": (CAPACITY, {"expert_tensor_parallel_size": 2, "expert_model_parallel_size": 2}),
    # Muon orthogonalises each expert over its expert-tensor-parallel shards, attention's over TP
    "muon_tp1_dp4_etp2_ep2": (MUON, {"expert_tensor_parallel_size": 2, "expert_model_parallel_size": 2}),
    "muon_tp2_dp2_etp1_ep2_distributed": (MUON, {**SP, "expert_tensor_parallel_size": 1,
                                                 "expert_model_parallel_size": 2, "muon_tp_mode": "distributed"}),
}
REFERENCES = {"moe": MOE, "modern": MODERN, "capacity": CAPACITY, "muon": MUON}
FOLDED = {**SP, "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 4}
UNFOLDED = {**SP, "expert_model_parallel_size": 2}  # ETP = TP = 2


# -- coordinates ----------------------------------------------------------------------------------------

def test_folded_groups_follow_the_etp_ep_edp_order():
    """tp2 x dp2 read as etp1 x ep2 x edp2, and tp1 x dp4 as etp2 x ep2 x edp1, written out by hand."""
    folded = Layout(tp=2, dp=2, ep=2, etp=1)
    assert [(c.etp, c.ep, c.edp) for c in map(lambda r: rank_coordinates(r, folded), range(4))] == [
        (0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)]
    assert group_ranks(folded, "ep") == [[0, 1], [2, 3]]  # the two TP ranks hold different experts
    assert group_ranks(folded, "expert_dp") == [[0, 2], [1, 3]]
    assert group_ranks(folded, "etp") == [[0], [1], [2], [3]]
    assert group_ranks(folded, "tp") == [[0, 1], [2, 3]]
    wide = Layout(dp=4, ep=2, etp=2)
    assert group_ranks(wide, "etp") == [[0, 1], [2, 3]]
    assert group_ranks(wide, "ep") == [[0, 2], [1, 3]]
    assert group_ranks(wide, "expert_dp") == [[0], [1], [2], [3]]
    pipelined = Layout(tp=2, pp=2, ep=2, etp=1)
    assert group_ranks(pipelined, "ep") == [[0, 1], [2, 3]]
    assert pipelined.edp == 1 and folded.edp == 2 and wide.edp == 1


@pytest.mark.parametrize("layout", [Layout(tp=2, dp=4, ep=2), Layout(tp=2, cp=2, dp=2, ep=4, pp=2),
                                    Layout(dp=8, ep=4), Layout(tp=4, dp=2)])
def test_etp_equal_to_tp_is_the_unfolded_layout(layout):
    """With ETP = TP the experts split the dp x cp index of a stage: ep = index mod EP, edp = index div EP."""
    assert layout.etp == layout.tp
    for rank in range(layout.world_size):
        c = rank_coordinates(rank, layout)
        dp_cp = c.cp + layout.cp * c.dp
        assert (c.etp, c.ep, c.edp) == (c.tp, dp_cp % layout.ep, dp_cp // layout.ep)
    assert group_ranks(layout, "etp") == group_ranks(layout, "tp")


@pytest.mark.parametrize(("flags", "world_size", "message"), [
    ({"expert_tensor_parallel_size": 1, "expert_model_parallel_size": 2, "tensor_model_parallel_size": 2}, 2,
     "expert-tensor-parallel-size (1) different from tensor-model-parallel-size (2) needs --sequence-parallel"),
    ({**SP, "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 8}, 4,
     "expert-tensor-parallel-size x expert-model-parallel-size (1 x 8 = 8) must divide tensor x context x "
     "data-parallel size (2 x 1 x 2 = 4)"),
    ({"expert_tensor_parallel_size": 3}, 3, "moe-ffn-hidden-size (64) must be divisible by "
                                            "expert-tensor-parallel-size (3)"),
    ({**SP, "expert_tensor_parallel_size": 1, "use_distributed_optimizer": True,
      "num_distributed_optimizer_instances": 2}, 4,
     "--num-distributed-optimizer-instances 2 needs expert-tensor-parallel-size (1) equal to "
     "tensor-model-parallel-size (2)"),
    ({"model_preset": "llama-tiny", "num_experts": None, "expert_tensor_parallel_size": 2}, 2,
     "--expert-tensor-parallel-size acts only with --num-experts"),
])
def test_impossible_expert_layouts_are_one_line(flags, world_size, message):
    with pytest.raises(ConfigError) as error:
        make_config({**MOE, **flags}, world_size)
    assert message in str(error.value)


# -- training -------------------------------------------------------------------------------------------

def _train(values: dict, world_size: int) -> dict:
    """Losses and MoE metrics per step; the last step's gradients of the router, expert and shared-expert weights
    as {global name: (split rank, spec, tensor)}, this rank's pieces (experts split over etp, the rest over tp)."""
    history, chunks = pretrain_keeping_chunks(values, world_size)
    grads = {name: (chunk.pstate.tensor_split.of(param.spec)[0], param.spec, param.main_grad.clone())
             for chunk in chunks for name, param in chunk.named_global_parameters()
             if ".mlp." in name and name.split(".mlp.")[1].startswith(("router.", "experts.", "shared_experts."))
             and param.main_grad is not None}
    return {"history": history, "grads": grads}


def _join(rank_results: list[dict]) -> dict:
    """{global name: global tensor} from every rank's pieces; replicas of a piece must agree."""
    pieces: dict[str, dict] = {}
    for result in rank_results:
        for name, (split_rank, spec, tensor) in result["grads"].items():
            held = pieces.setdefault(name, {})
            if split_rank in held:
                assert_close_relative(tensor, held[split_rank][1], rel=1e-6, msg=f"replicas of {name}")
            held[split_rank] = (spec, tensor)
    return {name: unshard([by_rank[r][1] for r in sorted(by_rank)], by_rank[0][0]) for name, by_rank in pieces.items()}


def _assert_runs_match(name: str, rank_results: list[dict], reference: dict, compare_grads: bool = False):
    for rank, result in enumerate(rank_results):
        for step, (got, expected) in enumerate(zip(result["history"], reference["history"], strict=True)):
            where = f"{name} rank {rank} step {step + 1}"
            assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=1e-5), where
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), where  # experts counted once
            for key, value in expected.items():
                if key.startswith(("moe_tokens_per_expert", "moe_dropped")):
                    assert got[key] == value, f"{where} {key}"
                elif key.startswith("moe_"):
                    assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-9), f"{where} {key}"
    if compare_grads:
        joined, expected = _join(rank_results), _join([reference])
        assert joined.keys() == expected.keys(), f"{name}: router/expert parameter names differ"
        for param_name, tensor in joined.items():
            assert_close_relative(tensor, expected[param_name], rel=1e-5, msg=f"{name}: gradient of {param_name}")


def _losses(values: dict, world_size: int) -> list[float]:
    return [record["lm_loss"] for record in _train(values, world_size)["history"]]


def _on_four_ranks(root: str) -> dict:
    """Every folded run of this file, in one world: each layout for 4 steps and for one step (gradients), and a
    checkpoint saved folded after 2 steps, resumed unfolded."""
    runs = {}
    for name, (model, flags) in LAYOUTS.items():
        runs[name] = _train({**model, **flags}, 4)
        if name.startswith(("tp", "modern")):
            runs[f"one_step_{name}"] = _train({**model, **flags, **ONE_STEP}, 4)
    runs["saved folded"] = _losses({**MODERN, **FOLDED, "exit_interval": 2, "save": f"{root}/folded"}, 4)
    runs["folded -> unfolded"] = _losses({**MODERN, **UNFOLDED, "load": f"{root}/folded"}, 4)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("folding")
    per_rank = run_on_ranks(4, _on_four_ranks, str(root), timeout=900)
    one_process = {model_name: _train(model, 1) for model_name, model in REFERENCES.items()}
    one_process |= {f"one_step_{name}": _train({**model, **ONE_STEP}, 1) for name, model in
                    (("moe", MOE), ("modern", MODERN))}
    one_process["folded -> one process"] = _losses({**MODERN, "load": f"{root}/folded"}, 1)
    return per_rank, one_process


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name.startswith(("tp", "modern"))])
def test_folded_layout_matches_one_process(layout, runs):
    per_rank, one_process = runs
    model = "modern" if layout.startswith("modern") else "moe"
    _assert_runs_match(layout, [ranks[layout] for ranks in per_rank], one_process[model])
    _assert_runs_match(layout, [ranks[f"one_step_{layout}"] for ranks in per_rank], one_process[f"one_step_{model}"],
                       compare_grads=True)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name.startswith("muon")])
def test_folded_experts_under_muon_match_one_process(layout, runs):
    per_rank, one_process = runs
    _assert_runs_match(layout, [ranks[layout] for ranks in per_rank], one_process["muon"])


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name.startswith("capacity")])
def test_folded_capacity_drops_the_same_token_copies(layout, runs):
    per_rank, one_process = runs
    reference = one_process["capacity"]
    assert all(record["moe_dropped_tokens_layer_0"] > 0 for record in reference["history"])
    _assert_runs_match(layout, [ranks[layout] for ranks in per_rank], reference)


def test_folded_checkpoint_resumes_unfolded_and_on_one_process(runs):
    per_rank, one_process = runs
    expected = [record["lm_loss"] for record in one_process["modern"]["history"]]
    saved = per_rank[-1]["saved folded"]
    assert saved == pytest.approx(expected[:2], rel=1e-5)
    assert saved + per_rank[-1]["folded -> unfolded"] == pytest.approx(expected, rel=1e-5)
    assert saved + one_process["folded -> one process"] == pytest.approx(expected, rel=1e-5)
