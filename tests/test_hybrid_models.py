"""Hybrid models, Gated DeltaNet layers between softmax-attention layers (--experimental-attention-variant
gated_delta_net): training equals one process under TP2 + SP, PP2 x VP2 (stages and virtual stages holding either
kind of layer) with full recomputation, CP2 (the linear layers by an all-to-all to a head split, the softmax
layers by each --cp-comm-type), ZeRO-3 over DP2 and, with MoE layers, experts folded over EP2 beside TP2, with
documents packed into the sequences (--reset-attention-mask); a checkpoint resumes bitwise and reshards; the
planner's parameters and the model FLOPs are the built model's; the layer pattern is Megatron's;
misconfigurations are one line each."""

from __future__ import annotations

import pytest

from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_pattern import linear_attention_pattern
from megatron_lite.errors import ConfigError
from tests.harness import run_on_ranks
from tests.helpers import (
    TINY_2_LAYERS,
    assert_layouts_match,
    assert_resumes_bitwise_and_reshards,
    assert_run_matches,
    losses_and_norms,
    reference,
    saved_bytes_per_token,
    train_and_collect,
)
from tests.test_window_and_sinks import GPT_OSS_LIKE

LINEAR = {"experimental_attention_variant": "gated_delta_net", "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4}
# Layers 0 and 2 Gated DeltaNet, 1 and 3 softmax attention; documents packed into each sequence
HYBRID = {**TINY_2_LAYERS, **LINEAR, "num_layers": 4, "linear_attention_freq": 2, "train_iters": 4,
          "reset_attention_mask": True, "reset_position_ids": True}
LAYOUTS = {  # on 2 ranks
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2_vp2_full_recompute": {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1,
                               "recompute_granularity": "full"},
    **{f"cp2_{kind}": {"context_parallel_size": 2, "cp_comm_type": kind} for kind in ("p2p", "allgather", "a2a")},
}
ZERO3 = {"use_distributed_optimizer": True, "data_parallel_sharding_strategy": "optim_grads_params"}
# Qwen3-Next's MoE layers (a gated shared expert) after a dense first layer, on 4 ranks: experts over EP2 with the
# dense layers over TP2 and each expert whole (parallel folding, --expert-tensor-parallel-size 1)
HYBRID_MOE = {**HYBRID, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
              "moe_layer_freq": "[0,1,1,1]", "moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True,
              "moe_aux_loss_coeff": 0.01}
FOLDED = {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
          "expert_tensor_parallel_size": 1}


def test_linear_attention_freq_is_megatrons_pattern():
    def pattern(freq, layers=8):
        return linear_attention_pattern(make_config({**LINEAR, "num_layers": layers, "linear_attention_freq": freq,
                                                     "mock_data": True, "vocab_size": 64}).model)

    assert pattern(4) == [True, True, True, False] * 2  # Qwen3-Next: three linear layers, then softmax attention
    assert pattern("2") == [True, False] * 4
    assert pattern("[1,0,0,1]*2") == [True, False, False, True] * 2
    assert pattern(1) == [False] * 8  # N = 1: no linear layer between the softmax ones
    softmax_only = make_config({"mock_data": True, "vocab_size": 64, "num_layers": 3}).model
    assert linear_attention_pattern(softmax_only) == [False] * 3


def _train_layouts() -> dict:
    runs = {name: train_and_collect({**HYBRID, **flags}, 2) for name, flags in LAYOUTS.items()}
    return runs, losses_and_norms({**HYBRID, **ZERO3}, 2)


def test_hybrid_models_train_as_one_process_under_tp_sp_pp_vp_zero3_and_recomputation():
    """Losses, final weights and last gradients equal one process's at TP2 + SP and PP2 x VP2; under ZeRO-3 (whose
    parameters live sharded, gathered only for compute) every step's loss and gradient norm."""
    assert_layouts_match(run_on_ranks(2, _train_layouts), LAYOUTS, reference(HYBRID), losses_and_norms(HYBRID, 1))


@pytest.mark.parametrize("values,message", [
    ({"linear_num_value_heads": 3}, r"linear-num-value-heads \(3\) must be a multiple of linear-num-key-heads \(2\)"),
    ({"tensor_model_parallel_size": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
      "num_attention_heads": 4, "num_query_groups": 4},
     r"tensor-model-parallel-size \(4\) must divide linear-num-key-heads \(2\)"),
    ({"linear_attention_freq": "[1,0,1]"}, r"--linear-attention-freq '\[1,0,1\]': the pattern has 3 entries for 4"),
    ({"linear_attention_freq": "__import__('os')"}, r"--linear-attention-freq .*Call is not allowed"),
    ({"context_parallel_size": 4}, r"context-parallel-size \(4\) must divide the linear-attention key heads of each "
                                   r"tensor-parallel rank \(linear-num-key-heads 2 / tensor-model-parallel-size 1\)"),
])
def test_impossible_linear_attention_settings_are_one_line(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config({**HYBRID, **values}, 4)


def test_linear_attention_flags_without_the_variant_are_refused():
    with pytest.raises(ConfigError, match="--linear-num-key-heads acts only with --experimental-attention-variant"):
        make_config({**TINY_2_LAYERS, "linear_num_key_heads": 4})


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("variant", ["hybrid", "output_gate_and_sinks", "mamba"])
def test_the_planner_counts_the_parameters_each_rank_builds(tp, pp, variant):
    """Parameter shapes in module order, per rank: the planner's ZeRO buckets and memory report rest on them. (A
    model built for TP rank 0 alone, with no process group: shapes are what the layout gives every rank.) The
    second model has Qwen3-Next's gated softmax attention and gpt-oss's learned sinks, the third Mamba-2 layers
    with and without an MLP."""
    import torch

    import pretrain_gpt
    from megatron_lite.config.layer_split import model_chunk_plans
    from megatron_lite.parallel.state import Layout, ParallelState
    from megatron_lite.planning.state_memory import chunk_params
    from tests.test_mamba2_parallel import HYBRID as MAMBA_HYBRID

    values = {"hybrid": HYBRID, "output_gate_and_sinks": {**GPT_OSS_LIKE, "attention_output_gate": True},
              "mamba": {**MAMBA_HYBRID, "hybrid_layer_pattern": "M-*-M-M"}}[variant]
    config = make_config({**values, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}, tp * pp)
    for pp_rank in range(pp):
        (plan,) = model_chunk_plans(config, pp_rank)
        pstate = ParallelState.without_groups(Layout.from_world(tp * pp, tp=tp, pp=pp), pp_rank * tp)
        model = pretrain_gpt.model_provider(config, pstate, plan, torch.device("cpu"))
        assert [shape.numel for shape in chunk_params(config, plan)] == [p.numel() for p in model.parameters()]
        first_layer = model.decoder.layers[0].self_attention
        kinds = {"hybrid": "GatedDeltaNet", "output_gate_and_sinks": "SelfAttention", "mamba": "Mamba2Mixer"}
        assert type(first_layer).__name__ == kinds[variant]


@pytest.mark.parametrize("seq_length", [32, 100], ids=["one_partial_chunk", "two_chunks"])
def test_model_flops_are_the_matmuls_torch_counts_in_a_forward(seq_length):
    """The forward's matrix products as torch's FLOP counter sees them (the model FLOPs are three forwards): the
    chunked delta rule's products over the padded chunks, both layer kinds' projections, the MLPs and the head;
    the softmax layers' attention square (SDPA's kernel, which the counter does not see) added from its
    definition, 2 x 2 x s x heads x head_dim."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.flops import training_flops_per_token
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.state import ParallelState

    values = {**HYBRID, "seq_length": seq_length, "max_position_embeddings": seq_length,
              "reset_attention_mask": False, "reset_position_ids": False}
    m = make_config(values).model
    model = GPTModel(m, ParallelState.single(), padded_vocab=m.vocab_size, seed=1)
    ids = torch.randint(0, m.vocab_size, (2, seq_length))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, torch.arange(seq_length), labels=ids)
    assert not any("attention" in str(op) for op in counter.get_flop_counts()["Global"])
    softmax_layers = m.num_layers - sum(linear_attention_pattern(m))
    counted = counter.get_total_flops() / (2 * seq_length) + softmax_layers * 4 * seq_length * 4 * m.head_dim
    assert training_flops_per_token(m) / 3 == pytest.approx(counted, rel=1e-12)


def _train_folded() -> tuple:
    return train_and_collect({**HYBRID_MOE, **FOLDED}, 4)


def test_a_hybrid_moe_model_trains_as_one_process_with_experts_folded_over_ep2_beside_tp2():
    assert_run_matches(run_on_ranks(4, _train_folded), reference(HYBRID_MOE), rel=1e-5, tensor_rel=1e-4)


def test_a_hybrid_checkpoint_resumes_bitwise_and_reshards_from_tp2_to_one_rank(tmp_path):
    """Saved at TP2, the linear heads and convolution channels are split."""
    assert_resumes_bitwise_and_reshards(HYBRID, tmp_path, {"tensor_model_parallel_size": 2})


def test_a_hybrid_model_trains_in_bf16_as_in_fp32_to_bf16_rounding():
    fp32 = losses_and_norms({**HYBRID, "train_iters": 3}, 1)
    bf16 = losses_and_norms({**HYBRID, "train_iters": 3, "bf16": True}, 1)
    for (loss, norm), (ref_loss, ref_norm) in zip(bf16, fp32, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-2) and norm == pytest.approx(ref_norm, rel=5e-2)


@pytest.mark.parametrize("recompute", [None, "selective"])
@pytest.mark.parametrize("bf16", [False, True])
def test_the_planned_gated_delta_net_bytes_per_token_are_what_autograd_saves(bf16, recompute):
    """Two sequence lengths cancel what does not grow with it; the layer's input (the norm's output, counted with
    the layer) and the parameters are left out."""
    import torch

    from megatron_lite.model.kinds.gated_delta_net import gated_delta_net_bytes
    from megatron_lite.model.linear_attention.gated_delta_net import GatedDeltaNet
    from megatron_lite.parallel.state import ParallelState

    config = make_config({**HYBRID, "bf16": bf16, "linear_value_head_dim": 6, "recompute_granularity": recompute})
    dtype = torch.bfloat16 if bf16 else torch.float32
    layer = GatedDeltaNet(config.model, ParallelState.single(), sequence_parallel=False)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.1)
    layer = layer.to(dtype)
    assert saved_bytes_per_token(layer, config.model.hidden_size, dtype) == gated_delta_net_bytes(config)
