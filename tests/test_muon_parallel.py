"""--optimizer muon trains as one process in every parallel layout, and its checkpoints resume and reshard.

DP2 (every replica orthogonalises alike), TP2 with --muon-tp-mode duplicated (the shards gathered) and
distributed (Gram matrices summed over TP), PP2, MoE at EP2 with the distributed optimizer, ZeRO-1 at DP4 and
TP2 x DP2 (each matrix gathered at its owner among the data-parallel ranks, its update scattered back) equal
one process: losses and gradient norms to rel 1e-5, weights and the optimizer state assembled from every
rank's shards (Muon's momentum buffers among them). Blockwise is another optimizer: its TP2 run leaves one
process. A checkpoint resumes bitwise, a TP2 x DP2 ZeRO-1 one continues on one rank as the uninterrupted run,
and resuming with the other optimizer is refused with one line.
"""

from __future__ import annotations

import pytest

import pretrain_gpt
from megatron_lite.checkpoint.planner import CheckpointError
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, train_with_state
from tests.test_distributed_optimizer import WEIGHT_TOLERANCE
from tests.test_moe_parallel import MOE
from tests.test_optimizer_instances import check_equals_one_process, train_and_describe

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MUON = {**TINY_2_LAYERS, "optimizer": "muon", "lr": 0.01, "train_iters": 6, "muon_nesterov": True}
MOE_MUON = {**MOE, "optimizer": "muon", "lr": 0.01, "train_iters": 6, "log_interval": 1000}
ZERO1 = {"use_distributed_optimizer": True}
TWO_RANKS = {"dp2": MUON, "tp2": {**MUON, "tensor_model_parallel_size": 2, "sequence_parallel": True},
             "tp2_distributed": {**MUON, "tensor_model_parallel_size": 2, "muon_tp_mode": "distributed"},
             "tp2_blockwise": {**MUON, "tensor_model_parallel_size": 2, "muon_tp_mode": "blockwise"},
             "pp2": {**MUON, "pipeline_model_parallel_size": 2},
             "moe_ep2_zero1": {**MOE_MUON, "expert_model_parallel_size": 2, **ZERO1}}
FOUR_RANKS = {"zero1_dp4": {**MUON, **ZERO1}, "zero1_tp2_dp2": {**MUON, "tensor_model_parallel_size": 2, **ZERO1},
              "zero3_dp4": {**MUON, "data_parallel_sharding_strategy": "optim_grads_params"}}


# Newton-Schulz amplifies the rounding of reordered gradient sums (its first polynomials have slope 3.4-8 near
# zero, and every update has norm ~ lr whatever the gradient's): after 6 steps the matrices of DP2, TP2, EP2 and
# ZeRO runs are up to 8e-6 apart from one process (measured; PP2 is bitwise), within ZeRO-2/3's Adam bound.
MATRIX_TOLERANCE = WEIGHT_TOLERANCE["optim_grads"]


def _describe_all(layouts: dict, world_size: int) -> dict:
    return {name: train_and_describe(values, world_size) for name, values in layouts.items()}


def test_every_layout_equals_one_process():
    reference, moe_reference = train_with_state(MUON, 1), train_with_state(MOE_MUON, 1)
    assert min(reference["norms"]) > MUON["clip_grad"]  # clipping acts in every step: the norm matters
    two = run_on_ranks(2, _describe_all, TWO_RANKS, 2)
    for name in ("dp2", "tp2", "tp2_distributed", "pp2"):
        check_equals_one_process([r[name] for r in two], reference, MATRIX_TOLERANCE)
    check_equals_one_process([r["moe_ep2_zero1"] for r in two], moe_reference, MATRIX_TOLERANCE)
    blockwise = two[0]["tp2_blockwise"]["losses"]
    assert blockwise[0] == pytest.approx(reference["losses"][0], rel=1e-6)  # same start, another optimizer
    assert abs(blockwise[-1] - reference["losses"][-1]) > 1e-4
    four = run_on_ranks(4, _describe_all, FOUR_RANKS, 4)
    for name in FOUR_RANKS:
        runs = [r[name] for r in four]
        check_equals_one_process(runs, reference, MATRIX_TOLERANCE)
        assert all(r["stepped"] < sum(t.numel() for t in reference["weights"].values()) for r in runs)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints

def train(values: dict, world_size: int) -> list[float]:
    config = make_config({**MUON, "train_iters": 10, **values}, world_size)
    return [h["lm_loss"] for h in pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)]


TP2_DP2 = {"tensor_model_parallel_size": 2, **ZERO1}


def _tp2_dp2_save_and_resume(root: str) -> dict:
    return {"uninterrupted": train(TP2_DP2, 4), "first": train({**TP2_DP2, "save": root, "exit_interval": 5}, 4),
            "resumed": train({**TP2_DP2, "load": root}, 4)}


def test_a_tp2_dp2_checkpoint_resumes_bitwise_and_continues_on_one_rank(tmp_path):
    four = run_on_ranks(4, _tp2_dp2_save_and_resume, str(tmp_path / "tp2dp2"))[-1]
    assert four["first"] == four["uninterrupted"][:5]
    assert four["resumed"] == four["uninterrupted"][5:]  # bitwise
    uninterrupted = train({}, 1)
    assert train({"load": str(tmp_path / "tp2dp2")}, 1) == pytest.approx(uninterrupted[5:], rel=1e-5)
    train({"save": str(tmp_path / "one"), "exit_interval": 5}, 1)
    assert train({"load": str(tmp_path / "one")}, 1) == uninterrupted[5:]  # bitwise


def test_resuming_with_the_other_optimizer_is_refused_in_one_line(tmp_path):
    train({"save": str(tmp_path), "exit_interval": 2}, 1)
    with pytest.raises(CheckpointError) as error:
        train({"load": str(tmp_path), "optimizer": "adam", "muon_nesterov": False}, 1)
    assert str(error.value) == (f"cannot load {tmp_path}/iter_0000002: its optimizer state is --optimizer muon's "
                                f"and this run has --optimizer adam; pass --no-load-optim to start adam from its "
                                f"weights")
    assert len(train({"load": str(tmp_path), "optimizer": "adam", "muon_nesterov": False,
                      "no_load_optim": True}, 1)) == 8
