"""Every recomputation option acts on every kind of layer: for softmax attention (plain, and with a window and
sinks), multi-latent attention, Gated DeltaNet and an MoE layer, --recompute-granularity selective and full each
make a training forward keep fewer bytes for backward, and leave the loss and every gradient as they were."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config.arguments import make_config
from megatron_lite.model.provider import build_model_chunk
from megatron_lite.parallel.state import ParallelState
from tests.helpers import TINY_2_LAYERS
from tests.test_hybrid_models import LINEAR
from tests.test_mla import TRAIN as MLA
from tests.tolerances import assert_close_relative

_STACK = ("num_layers", "multi_latent_attention", "experimental_attention_variant")
BASE = {k: v for k, v in TINY_2_LAYERS.items() if k not in _STACK}
KINDS = {
    "softmax attention": {"hybrid_layer_pattern": "*-"},
    "window and sinks": {"hybrid_layer_pattern": "*-", "window_size": [5, 0], "softmax_type": "learnable"},
    "multi-latent attention": {**{k: v for k, v in MLA.items() if k not in _STACK}, "hybrid_layer_pattern": "+-"},
    "Gated DeltaNet": {**{k: v for k, v in LINEAR.items() if k not in _STACK}, "hybrid_layer_pattern": "G-"},
    "MoE layer": {"hybrid_layer_pattern": "*E", "num_experts": 4, "moe_ffn_hidden_size": 32},
}


def _saved_bytes_loss_and_gradients(values: dict) -> tuple[int, float, dict]:
    """Bytes of the distinct storages autograd keeps in one training forward of a one-layer model (its parameters
    and inputs left out), the loss, and the gradients of its backward."""
    config = make_config({**BASE, **values, "attention_dropout": 0.0, "hidden_dropout": 0.0})
    torch.manual_seed(0)
    model = build_model_chunk(config, ParallelState.single()).train()
    tokens = torch.randint(0, config.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in skip and tensor.is_floating_point():
            saved[pointer] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, torch.arange(32), labels=tokens.roll(-1, dims=1)).float().mean()
    loss.backward()
    return sum(saved.values()), loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_each_recompute_option_keeps_fewer_bytes_on_each_layer_kind_and_changes_no_number(kind):
    plain_bytes, plain_loss, plain_grads = _saved_bytes_loss_and_gradients(KINDS[kind])
    for option in ("selective", "full"):
        saved, loss, grads = _saved_bytes_loss_and_gradients({**KINDS[kind], "recompute_granularity": option})
        assert saved < plain_bytes, (kind, option, saved, plain_bytes)
        assert loss == pytest.approx(plain_loss, rel=1e-6), (kind, option)
        for name, grad in grads.items():
            assert_close_relative(grad, plain_grads[name], rel=1e-5, msg=f"{kind}, {option}: {name}")
