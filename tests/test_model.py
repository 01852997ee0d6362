"""Model construction: layout-independent initialization, layer ranges, recomputation changes no numbers."""

import pytest
import torch

from megatron_lite.config.arguments import make_config
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState
from tests.tolerances import assert_close_relative

VALUES = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 4, "seq_length": 32,
          "max_position_embeddings": 32}


def build(values=VALUES, **kwargs):
    config = make_config(values).model
    return GPTModel(config, ParallelState.single(), padded_vocab=1024, seed=11, **kwargs)


def test_initial_weights_depend_on_seed_and_global_name_only():
    full = dict(build().named_global_parameters())
    second_half = dict(build(pre_process=False, layer_offset=2, num_layers=2).named_global_parameters())
    assert "decoder.layers.3.mlp.linear_fc1.weight" in second_half
    for name, param in second_half.items():
        torch.testing.assert_close(param, full[name], rtol=0, atol=0)
    first, other_seed = full["decoder.layers.0.mlp.linear_fc1.weight"], full["decoder.layers.1.mlp.linear_fc1.weight"]
    assert not torch.equal(first, other_seed)


def test_init_follows_megatron_scaling():
    params = dict(build().named_global_parameters())
    std = 0.02
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].std().item() == pytest.approx(std, rel=0.05)
    scaled = params["decoder.layers.0.self_attention.linear_proj.weight"].std().item()
    assert scaled == pytest.approx(std / (2 * 4) ** 0.5, rel=0.05)
    assert torch.equal(params["decoder.layers.0.input_layernorm.weight"], torch.ones(128))
    assert torch.all(params["embedding.word_embeddings.weight"][1024:] == 0)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputation_gives_identical_gradients(granularity):
    ids = torch.randint(0, 1024, (2, 32))
    grads = []
    for values in (VALUES, {**VALUES, "recompute_granularity": granularity}):
        model = build(values)
        model(ids, torch.arange(32), labels=ids).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        assert_close_relative(grads[1][name], grad, rel=1e-6, msg=name)


def test_dropout_masks_replay_under_recomputation():
    values = {**VALUES, "hidden_dropout": 0.2, "attention_dropout": 0.2}
    ids = torch.randint(0, 1024, (2, 32))
    grads = []
    for extra in ({}, {"recompute_granularity": "full"}):
        torch.manual_seed(5)
        model = build({**values, **extra})
        torch.manual_seed(6)
        model(ids, torch.arange(32), labels=ids).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert_close_relative(a, b, rel=1e-6)
