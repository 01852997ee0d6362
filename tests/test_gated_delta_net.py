"""Gated DeltaNet (model/linear_attention/gated_delta_net.py) computes what transformers' Qwen3-Next layer
computes, and keeps packed documents apart."""

from __future__ import annotations

import torch

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.linear_attention.gated_delta_net import GatedDeltaNet
from megatron_lite.model.sharding import ShardSpec
from megatron_lite.parallel.state import ParallelState
from tests.tolerances import assert_close_relative

SHAPE = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
             linear_value_head_dim=6, linear_conv_kernel_dim=4)


def _hf_layer():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(**SHAPE, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=64, vocab_size=64, rms_norm_eps=1e-6, hidden_act="silu")
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    with torch.no_grad():  # away from the initial values, so that every parameter's place is tested
        for param in layer.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return layer


def _ours_from(hf) -> GatedDeltaNet:
    """Our layer holding the HF layer's weights: the projections interleaved per key head ([q, k, v, z] of
    in_proj_qkvz beside [b, a] of in_proj_ba), the convolution's [q; k; v] channels regrouped per key head."""
    config = ModelConfig(**SHAPE, experimental_attention_variant="gated_delta_net", norm_epsilon=1e-6)
    ours = GatedDeltaNet(config, ParallelState.single(), sequence_parallel=False)
    nk, dk = SHAPE["linear_num_key_heads"], SHAPE["linear_key_head_dim"]
    hidden = SHAPE["hidden_size"]
    conv = hf.conv1d.weight  # [channels, 1, kernel]
    q, k, v = conv.split([nk * dk, nk * dk, conv.shape[0] - 2 * nk * dk])
    with torch.no_grad():
        ours.in_proj.weight.copy_(torch.cat([hf.in_proj_qkvz.weight.view(nk, -1, hidden),
                                             hf.in_proj_ba.weight.view(nk, -1, hidden)], dim=1).reshape(-1, hidden))
        ours.conv1d_weight.copy_(torch.cat([part.reshape(nk, -1, conv.shape[-1]) for part in (q, k, v)], dim=1)
                                 .reshape(conv.shape))
        ours.A_log.copy_(hf.A_log)
        ours.dt_bias.copy_(hf.dt_bias)
        ours.norm_weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)
    return ours


def test_the_layer_equals_transformers_qwen3_next_layer_forward_and_backward():
    hf = _hf_layer()
    ours = _ours_from(hf)
    x = torch.randn(2, 70, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))  # > one 64-token chunk
    hf_x, our_x = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    expected = hf(hf_x)
    out = ours(our_x).transpose(0, 1)
    assert_close_relative(out, expected.detach(), rel=1e-5, msg="output")
    weights = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (expected * weights).sum().backward()
    (out * weights).sum().backward()
    assert_close_relative(our_x.grad.transpose(0, 1), hf_x.grad, rel=1e-5, msg="input gradient")
    assert_close_relative(ours.out_proj.weight.grad, hf.out_proj.weight.grad, rel=1e-5, msg="out_proj")
    assert_close_relative(ours.A_log.grad, hf.A_log.grad, rel=1e-5, msg="A_log")
    assert_close_relative(ours.norm_weight.grad, hf.norm.weight.grad, rel=1e-5, msg="norm")


def test_the_layer_in_bf16_is_as_close_to_fp32_as_transformers_layer_in_bf16():
    """bf16 rounds differently here and there (which products round before the norm, the gate): both layers'
    distance from the fp32 result is the measure, and ours is no larger than twice transformers'."""
    x = torch.randn(2, 70, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(1))
    exact = _hf_layer()(x).detach()
    theirs = _hf_layer().to(torch.bfloat16)(x.to(torch.bfloat16)).float().detach()
    ours_layer = _ours_from(_hf_layer()).to(torch.bfloat16)
    ours = ours_layer(x.to(torch.bfloat16).transpose(0, 1).clone().requires_grad_()).transpose(0, 1)
    assert ours.dtype == torch.bfloat16
    ours.float().sum().backward()  # the backward runs in bf16 too
    our_error, their_error = ((ours.float().detach() - exact).norm() / exact.norm(),
                              (theirs - exact).norm() / exact.norm())
    assert 0 < our_error <= 2 * their_error, (our_error, their_error)


def test_a_packed_document_is_computed_as_if_alone():
    """The second document's outputs equal the layer on that document alone: neither the convolution's taps nor
    the recurrent state carry anything across the document's start."""
    from megatron_lite.model.attention.self_attention import Documents, Positions

    ours = _ours_from(_hf_layer())
    x = torch.randn(50, 1, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(3))
    ids = torch.zeros(1, 50, dtype=torch.long)
    ids[0, 19:] = 1
    with torch.no_grad():
        packed = ours(x, Positions(documents=Documents(ids, x.device)))
        alone = ours(x[19:])
        whole = ours(x)
    assert_close_relative(packed[19:], alone, rel=1e-5)
    assert_close_relative(packed[:19], whole[:19], rel=1e-5)
    assert (packed[19:] - whole[19:]).abs().max() > 1e-3  # without the documents the second one differs


def test_the_spec_of_every_parameter_splits_whole_heads_over_tensor_parallel_ranks():
    ours = GatedDeltaNet(ModelConfig(**SHAPE, experimental_attention_variant="gated_delta_net"),
                         ParallelState.single(), sequence_parallel=False)
    specs = {name: param.spec for name, param in ours.named_parameters()}
    assert all(isinstance(spec, ShardSpec) for spec in specs.values())
    assert specs["in_proj.weight"].tp_dim == specs["conv1d_weight"].tp_dim == specs["A_log"].tp_dim == 0
    assert specs["out_proj.weight"].tp_dim == 1 and specs["norm_weight"].tp_dim is None
