"""The MoE layer on one process against a plain-PyTorch reference written here: routing (Mixtral and
pre-softmax), experts (SwiGLU and GELU), the aux loss and z-loss values and their gradients, capacity drops;
global expert names; one-line configuration errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import ConfigError, make_config
from megatron_lite.model.gpt import GPTModel
from megatron_lite.model.moe import MoELayer, moe_metrics, moe_mlp_factory, set_moe_loss_scale
from megatron_lite.model.moe_router import capacity_keep_mask, expert_capacity
from megatron_lite.model.sharding import initialize_parameters
from megatron_lite.parallel.state import Layout, ParallelState
from tests.tolerances import assert_close_relative

BASE = {"model_preset": "mixtral-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
        "moe_ffn_hidden_size": 48, "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
        "moe_z_loss_coeff": 0.001, "seq_length": 8, "max_position_embeddings": 8}


def _layer(values: dict) -> MoELayer:
    config = make_config({**BASE, **values})
    layer = MoELayer(config.model, ParallelState.single(), 0, sequence_parallel=False,
                     token_dispatcher=config.model.moe_token_dispatcher_type)
    initialize_parameters(layer.named_parameters(), 7, 0.2, 2, 0, 1)
    return layer


def _naive_keep(probs, indices, num_experts, capacity):
    """Each expert keeps its `capacity` most probable tokens, the earlier token first on ties."""
    keep, probs = torch.zeros_like(indices, dtype=torch.bool), probs.detach()
    for expert in range(num_experts):
        queue = sorted((-float(probs[t, j]), t, j) for t in range(indices.shape[0])
                        for j in range(indices.shape[1]) if indices[t, j] == expert)
        for _, t, j in queue[:capacity]:
            keep[t, j] = True
    return keep


def _reference(layer: MoELayer, x: torch.Tensor, capacity_factor=None):
    """Plain PyTorch: (output [T, h], aux loss, z-loss, keep mask) from the layer's weights."""
    m = layer.router
    logits = x @ m.weight.t()
    num_tokens, num_experts, topk = logits.shape[0], logits.shape[1], m.topk
    if m.pre_softmax:
        probs, indices = torch.softmax(logits, -1).topk(topk, -1)
    else:
        top, indices = logits.topk(topk, -1)
        probs = torch.softmax(top, -1)
    keep = torch.ones_like(indices, dtype=torch.bool)
    if capacity_factor is not None:
        keep = _naive_keep(probs, indices, num_experts, expert_capacity(num_tokens, num_experts, topk, capacity_factor))
    out = torch.zeros_like(x)
    for t in range(num_tokens):
        for j in range(topk):
            if keep[t, j]:
                expert = layer.experts[int(indices[t, j])]
                hidden = x[t] @ expert.linear_fc1.weight.t()
                if layer.experts[0].config.swiglu:
                    gate, up = hidden.chunk(2)
                    hidden = F.silu(gate) * up
                else:
                    hidden = F.gelu(hidden)
                out[t] = out[t] + probs[t, j] * (hidden @ expert.linear_fc2.weight.t())
    fraction = torch.bincount(indices.reshape(-1), minlength=num_experts) / (num_tokens * topk)
    aux = m.aux_loss_coeff * num_experts * (fraction * torch.softmax(logits, -1).mean(0)).sum()
    z = m.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return out, aux, z, keep


@pytest.mark.parametrize("variant", [{}, {"swiglu": False, "moe_router_pre_softmax": True},
                                     {"moe_expert_capacity_factor": 0.5},
                                     {"moe_token_dispatcher_type": "allgather", "moe_expert_capacity_factor": 0.75}])
def test_moe_layer_and_its_losses_match_a_direct_computation(variant):
    """Output, logged aux/z-loss and the gradients of mean(loss) + aux + z equal the reference's."""
    torch.manual_seed(0)
    layer = _layer(variant)
    s, b, h = 8, 2, BASE["hidden_size"]
    x = torch.randn(s, b, h, requires_grad=True)
    upstream = torch.randn(s, b, h)  # d(per-token loss sum)/d(output), standing in for the layers above

    (layer(x) * upstream).sum().backward()  # the training loss is a sum over the T = s b tokens
    grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()

    tokens = x.reshape(-1, h)
    out, aux, z, keep = _reference(layer, tokens, variant.get("moe_expert_capacity_factor"))
    ((out * upstream.reshape(-1, h)).sum() / (s * b) + aux + z).backward()  # mean loss + aux + z
    expected = [x.grad] + [p.grad for p in layer.parameters()]
    for (name, _), got, want in zip([("x", None), *layer.named_parameters()], grads, expected, strict=True):
        assert_close_relative(got / (s * b), want, rel=1e-5, msg=name)

    with torch.no_grad():
        assert_close_relative(layer(x).reshape(-1, h), out, rel=1e-5)
    metrics = moe_metrics([layer], ParallelState.single(), make_config({**BASE, "num_layers": 1, **variant}))
    assert metrics["moe_aux_loss_layer_0"] == pytest.approx(aux.item(), rel=1e-5)
    assert metrics["moe_z_loss_layer_0"] == pytest.approx(z.item(), rel=1e-5)
    assert metrics["moe_dropped_tokens_layer_0"] == int((~keep).sum())
    assert sum(metrics["moe_tokens_per_expert_layer_0"]) == s * b * BASE["moe_router_topk"]
    if "moe_expert_capacity_factor" in variant:
        assert 0 < metrics["moe_dropped_tokens_layer_0"] < s * b * BASE["moe_router_topk"]
    assert layer.statistics is None  # read and reset; the no-grad forward above recorded nothing


def test_moe_loss_gradients_follow_the_fp16_loss_scale():
    """The schedule multiplies the language-model loss by the loss scale; the MoE losses' gradients too."""
    torch.manual_seed(0)
    layer = _layer({})
    x, upstream = torch.randn(8, 2, BASE["hidden_size"]), torch.randn(8, 2, BASE["hidden_size"])
    (layer(x) * upstream).sum().backward()
    unscaled = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    set_moe_loss_scale([layer], 1024.0)
    ((layer(x) * upstream).sum() * 1024.0).backward()
    for got, want in zip([p.grad for p in layer.parameters()], unscaled, strict=True):
        assert_close_relative(got / 1024.0, want, rel=1e-5)


def test_capacity_keeps_the_most_probable_tokens_and_breaks_ties_by_position():
    probs = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.5, 0.5], [0.6, 0.4]])
    indices = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    # Capacity ceil(4 * 2 / 2 * 0.5) = 2: expert 0 keeps token 1 (0.9) and token 0 (0.5, before token 2);
    # expert 1 keeps token 3 (0.6) and token 0 (0.5, before token 2).
    keep = capacity_keep_mask(probs, indices, num_experts=2, capacity_factor=0.5)
    assert keep.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    torch.manual_seed(1)
    probs, indices = torch.rand(64, 2), torch.rand(64, 6).argsort(-1)[:, :2]
    assert torch.equal(capacity_keep_mask(probs, indices, 6, 1.0), _naive_keep(probs, indices, 6, 22))


def test_local_experts_carry_global_names_and_single_device_weights():
    """Local expert j of EP rank r is decoder.layers.<l>.mlp.experts.<r E/ep + j> with the weights that
    expert has on one device; every other MoE layer with --moe-layer-freq 2."""
    config = make_config({**BASE, "num_layers": 4, "moe_layer_freq": 2})
    single = GPTModel(config.model, ParallelState.single(), padded_vocab=1024, seed=3,
                      mlp_factory=moe_mlp_factory(config, ParallelState.single()))
    reference = dict(single.named_global_parameters())
    assert {n for n in reference if ".mlp.router." in n} == {f"decoder.layers.{n}.mlp.router.weight" for n in (0, 2)}
    ep_rank_1 = ParallelState.without_groups(Layout(dp=2, ep=2), 1)  # building and naming need no collective
    shard = GPTModel(config.model, ep_rank_1, padded_vocab=1024, seed=3, mlp_factory=moe_mlp_factory(config, ep_rank_1))
    names = dict(shard.named_global_parameters())
    experts = sorted({n.split(".linear")[0] for n in names if ".experts." in n})
    assert experts == [f"decoder.layers.{layer}.mlp.experts.{e}" for layer in (0, 2) for e in (2, 3)]
    for name, param in names.items():
        assert param.spec.expert == (".experts." in name)
        assert torch.equal(param, reference[name]), name


@pytest.mark.parametrize(("values", "world_size", "message"), [
    ({"num_experts": 6, "expert_model_parallel_size": 4}, 4,
     "num-experts (6) must be divisible by expert-model-parallel-size (4)"),
    ({"moe_router_topk": 5}, 1, "moe-router-topk (5) must not exceed num-experts (4)"),
    ({"expert_model_parallel_size": 4, "tensor_model_parallel_size": 2}, 4,
     "expert-model-parallel-size (4) must divide data-parallel x context-parallel size (2 x 1 = 2)"),
    ({"disable_bias_linear": False}, 1, "MoE experts have no biases: pass --disable-bias-linear"),
    ({"moe_expert_capacity_factor": 0.0}, 1, "moe-expert-capacity-factor (0.0) must be positive"),
    ({"moe_ffn_hidden_size": 50, "tensor_model_parallel_size": 4}, 4,
     "moe-ffn-hidden-size (50) must be divisible by tensor-model-parallel-size (4)"),
])
def test_bad_moe_configuration_is_one_line_error(values, world_size, message):
    with pytest.raises(ConfigError) as error:
        make_config({**BASE, **values}, world_size)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
