"""A Mamba-2 hybrid (Nemotron-H's form: Mamba-2 layers with and without an MLP, softmax attention) trains as one
process under every parallel dimension: TP2 + SP, PP2 x VP2 by the pattern's | stages, CP2 (p2p and a2a), ZeRO-3,
full and selective recomputation, and its MoE form (latent experts, a shared expert) with experts folded over EP2
beside TP2."""

from __future__ import annotations

import pytest

from tests.harness import run_on_ranks
from tests.helpers import (
    TINY_2_LAYERS,
    assert_layouts_match,
    assert_resumes_bitwise_and_reshards,
    assert_run_matches,
    losses_and_norms,
    reference,
    train_and_collect,
    train_losses,
)
from tests.test_mamba2 import MAMBA

# Layers M-, M, *-, M- over four | segments; documents packed into each sequence
HYBRID = {**{k: v for k, v in TINY_2_LAYERS.items() if k != "num_layers"}, **MAMBA,
          "hybrid_layer_pattern": "M-|M|*-|M-", "train_iters": 4, "reset_attention_mask": True,
          "reset_position_ids": True}
LAYOUTS = {  # on 2 ranks
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2_vp2_full_recompute": {"pipeline_model_parallel_size": 2, "recompute_granularity": "full"},
    "selective_recompute_cp2_p2p": {"context_parallel_size": 2, "recompute_granularity": "selective"},
    "cp2_a2a": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
}
ZERO3 = {"use_distributed_optimizer": True, "data_parallel_sharding_strategy": "optim_grads_params"}
# Nemotron 3 Super's form: MoE layers after the Mamba-2 mixers and the attention, their routed experts in a latent
# of 24 beside a shared expert, on 4 ranks: experts over EP2 with the dense layers over TP2 + SP and each expert
# whole (parallel folding)
HYBRID_MOE = {**HYBRID, "hybrid_layer_pattern": "MEM*E", "num_experts": 4, "moe_router_topk": 2,
              "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.01, "moe_latent_size": 24,
              "moe_shared_expert_intermediate_size": 48}
FOLDED = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
          "expert_tensor_parallel_size": 1}


def _train_layouts() -> tuple:
    runs = {name: train_and_collect({**HYBRID, **flags}, 2) for name, flags in LAYOUTS.items()}
    return runs, losses_and_norms({**HYBRID, **ZERO3}, 2)


def test_a_mamba_hybrid_trains_as_one_process_under_tp_sp_pp_vp_cp_zero3_and_recomputation():
    """Losses, final weights and last gradients equal one process's; under ZeRO-3 (whose parameters live sharded)
    every step's loss and gradient norm."""
    assert_layouts_match(run_on_ranks(2, _train_layouts), LAYOUTS, reference(HYBRID), losses_and_norms(HYBRID, 1))


def _train_folded() -> tuple:
    return train_and_collect({**HYBRID_MOE, **FOLDED}, 4)


def test_a_mamba_moe_hybrid_trains_as_one_process_with_experts_folded_over_ep2_beside_tp2():
    assert_run_matches(run_on_ranks(4, _train_folded), reference(HYBRID_MOE), rel=1e-5, tensor_rel=1e-4)


def test_a_mamba_hybrid_checkpoint_resumes_bitwise_and_reshards_from_tp2_to_one_rank(tmp_path):
    """Saved at TP2, the Mamba-2 groups (their projection rows, convolution channels and heads) are split."""
    assert_resumes_bitwise_and_reshards(HYBRID, tmp_path, {"tensor_model_parallel_size": 2})


def test_megatron_lm_checkpoints_of_mamba_hybrids_are_refused_in_one_line_both_ways(tmp_path):
    """Megatron-Core's MambaMixer needs mamba_ssm's CUDA kernels: no CPU reference checks its tensor names, so
    neither direction guesses them. Nothing is written."""
    from megatron_lite.errors import ConfigError
    from megatron_lite.megatron_lm.arguments import flags_from_megatron
    from tests.helpers import convert

    train_losses({**HYBRID, "train_iters": 2, "save": str(tmp_path / "ckpt")}, 1)
    with pytest.raises(SystemExit, match=r"has Mamba-2 layers or squared-ReLU MLPs .* export it with --direction "
                                         r"mlite-to-hf instead"):
        convert("--direction", "mlite-to-megatron", "--load-dir", str(tmp_path / "ckpt"), "--save-dir",
                str(tmp_path / "mlm"))
    assert not (tmp_path / "mlm").exists()
    args = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "padded_vocab_size": 256,
            "hybrid_override_pattern": "M-M*-"}
    with pytest.raises(ConfigError, match=r"was trained with --hybrid-override-pattern M-M\*-, which this framework "
                                          r"does not build"):
        flags_from_megatron(args, "iter_0000001")
