"""--recompute-method with Megatron's meanings: which layers full recomputation reruns, and that it changes no
gradients."""

import pytest
import torch

from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.model import transformer
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState
from tests.tolerances import assert_close_relative

VALUES = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 5, "seq_length": 16,
          "max_position_embeddings": 16, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 4}


def run(extra, monkeypatch):
    """One forward and backward; returns the gradients, each layer's forward calls and the checkpointed units
    (as lists of global layer numbers)."""
    model = GPTModel(make_config({**VALUES, **extra}).model, ParallelState.single(), padded_vocab=1024, seed=3)
    calls = [0] * VALUES["num_layers"]
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda module, args: calls.__setitem__(module.layer_number,
                                                                                calls[module.layer_number] + 1))
    units, checkpoint = [], transformer.checkpoint
    monkeypatch.setattr(transformer, "checkpoint", lambda run, *args: (
        units.append([layer.layer_number for layer in run.layers]), checkpoint(run, *args))[1])
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, torch.arange(16), labels=ids).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, calls, units


@pytest.mark.parametrize(("extra", "recomputed", "units"), [
    ({"recompute_method": "uniform", "recompute_num_layers": 2}, [0, 1, 2, 3, 4], [[0, 1], [2, 3], [4]]),
    ({"recompute_method": "uniform", "recompute_num_layers": 1}, [0, 1, 2, 3, 4], [[0], [1], [2], [3], [4]]),
    ({"recompute_method": "block", "recompute_num_layers": 2}, [0, 1], [[0], [1]]),
    ({}, [0, 1, 2, 3, 4], [[0], [1], [2], [3], [4]]),
])
def test_recompute_method_reruns_the_layers_megatron_says_and_keeps_the_gradients(extra, recomputed, units,
                                                                                  monkeypatch):
    plain, plain_calls, plain_units = run({}, monkeypatch)
    assert plain_calls == [1] * 5 and plain_units == []
    grads, calls, checkpointed = run({"recompute_granularity": "full", **extra}, monkeypatch)
    assert calls == [2 if layer in recomputed else 1 for layer in range(5)]
    assert checkpointed == units
    for name, grad in plain.items():
        assert_close_relative(grads[name], grad, rel=1e-6, msg=name)


def test_block_counts_layers_per_pipeline_stage(monkeypatch):
    """Each model chunk (here the second of two stages, global layers 3 and 4) recomputes its own first N."""
    config = make_config({**VALUES, "recompute_granularity": "full", "recompute_method": "block",
                          "recompute_num_layers": 1}).model
    model = GPTModel(config, ParallelState.single(), padded_vocab=1024, seed=3, layer_offset=3, num_layers=2)
    assert [(layers, recompute) for layers, recompute in model.decoder.recompute_units] == [
        (slice(0, 1), True), (slice(1, 2), False)]


@pytest.mark.parametrize(("extra", "message"), [
    ({"recompute_method": "uniform", "recompute_num_layers": 2},
     "--recompute-method acts only with --recompute-granularity full"),
    ({"recompute_granularity": "full", "recompute_method": "block"},
     "--recompute-method block needs --recompute-num-layers"),
])
def test_recompute_method_misuse_is_one_line(extra, message):
    with pytest.raises(ConfigError, match=message):
        make_config({**VALUES, **extra})
