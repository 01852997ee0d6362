"""--hybrid-layer-pattern, Megatron's one-string description of the stack: each preset builds the same network from
its flags and from its pattern; Megatron's own example forms train as one process at PP2 (the | stages), TP2 and
EP2; a pattern that cannot be built, or flags beside it that describe another network, are one line each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_pattern import linear_attention_pattern, moe_layer_pattern
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.config.presets import MODEL_PRESETS
from megatron_lite.errors import ConfigError
from megatron_lite.model.provider import build_model_chunk
from megatron_lite.parallel.state import ParallelState
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, assert_run_matches, reference, train_and_collect
from tests.test_hybrid_models import LINEAR
from tests.test_mamba2 import MAMBA
from tests.test_mla import TRAIN as MLA

# Each preset's stack written in Megatron's symbols (a mixer, then its MLP, per transformer layer)
PRESET_PATTERNS = {
    "gpt2-124m": "*-" * 12, "llama-tiny": "*-" * 4, "llama3-8b": "*-" * 32, "llama3-70b": "*-" * 80,
    "llama3.1-405b": "*-" * 126, "llama3.2-1b": "*-" * 16, "qwen3-0.6b": "*-" * 28, "qwen3-30b-a3b": "*E" * 48,
    "qwen1.5-moe-a2.7b": "*E" * 24, "deepseek-v3": "+-" * 3 + "+E" * 58, "moonlight-16b": "+-" + "+E" * 26,
    "qwen3-next-80b-a3b": "GEGEGE*E" * 12, "qwen3.5-9b": "G-G-G-*-" * 8, "qwen3.5-35b-a3b": "GEGEGE*E" * 10,
    "gpt-oss-20b": "*E" * 24, "gpt-oss-120b": "*E" * 36, "mixtral-tiny": "*E" * 4,
    "nemotron-h-8b": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "nemotron-3-nano-30b-a3b": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "nemotron-3-super-120b-a12b": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*"
                                  "EMEMEMEME/*E",
}


def _network(values: dict) -> dict:
    """Every model setting of `values`, the per-layer flags as one bool per layer (the list a flag's forms give)."""
    m = make_config(values).model
    settings = {**dataclasses.asdict(m), "moe_layer_freq": moe_layer_pattern(m),
                "linear_attention_freq": linear_attention_pattern(m)}
    del settings["hybrid_layer_pattern"]
    return settings


def test_every_preset_has_a_pattern_and_it_builds_the_same_network():
    """The settings the model is built from are the same (the small networks below are built and compared)."""
    assert set(PRESET_PATTERNS) == set(MODEL_PRESETS)
    for preset, pattern in PRESET_PATTERNS.items():
        flags = {"model_preset": preset, "mock_data": True}
        assert _network({**flags, "hybrid_layer_pattern": pattern}) == _network(flags), preset


# Small networks of each kind: (flags, the same stack as a pattern)
SMALL = {
    "dense": ({}, "*-*-"),
    "moe_mtp": ({**MLA, "num_experts": 4, "moe_ffn_hidden_size": 32, "moe_layer_freq": "[0,1]",
                 "mtp_num_layers": 1}, "+-+E/+E"),
    "hybrid": ({**LINEAR, "num_layers": 4, "linear_attention_freq": 2}, "G-*-G-*-"),
    "gpt_oss_like": ({"num_experts": 4, "window_size": [5, 0], "window_attn_skip_freq": 2,
                      "softmax_type": "learnable"}, "*E*E"),
}


@pytest.mark.parametrize("kind", SMALL)
def test_a_pattern_gives_the_same_parameter_names_shapes_and_initial_values(kind):
    flags, pattern = SMALL[kind]
    old = {**TINY_2_LAYERS, **flags}
    new = {**{k: v for k, v in old.items() if k not in ("num_layers", "moe_layer_freq", "linear_attention_freq",
                                                        "mtp_num_layers", "multi_latent_attention")},
           "hybrid_layer_pattern": pattern}
    built = [dict(build_model_chunk(make_config(values), ParallelState.single()).named_global_parameters())
             for values in (old, new)]
    assert list(built[0]) == list(built[1])
    for name, tensor in built[0].items():
        assert torch.equal(tensor, built[1][name]), name


def test_the_stages_of_a_pattern_are_megatrons_flexible_virtual_stages():
    """Chunk c of stage p is segment c x PP + p, in the order micro-batches flow."""
    values = {k: v for k, v in TINY_2_LAYERS.items() if k != "num_layers"}
    config = make_config({**values, "hybrid_layer_pattern": "*-|*-*-|*-|*-*-*-", "pipeline_model_parallel_size": 2}, 2)
    assert config.virtual_pipeline_stages == 2 and config.model.num_layers == 7
    plans = [[(plan.layer_offset, plan.num_layers) for plan in model_chunk_plans(config, stage)] for stage in (0, 1)]
    assert plans == [[(0, 1), (3, 1)], [(1, 2), (4, 3)]]


# Megatron's examples that this version builds, as small networks
EXAMPLES = {
    "G-G-|G-*-/*-": {**LINEAR},
    "+E+E|+E+E/+E": {**MLA, "num_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2},
    "*-*-|*-*E": {"num_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2},
    "M-M-|M-M*-/MM/MM": {**MAMBA},
    "MEM*E|MME": {**MAMBA, "num_experts": 4, "moe_ffn_hidden_size": 32, "moe_router_topk": 2},
}
LAYOUTS = {"pp2": {"pipeline_model_parallel_size": 2}, "tp2": {"tensor_model_parallel_size": 2},
           "ep2": {"expert_model_parallel_size": 2}}


def _example(pattern: str) -> dict:
    values = {k: v for k, v in {**TINY_2_LAYERS, **EXAMPLES[pattern]}.items() if k != "num_layers"}
    return {**values, "hybrid_layer_pattern": pattern, "train_iters": 3, "global_batch_size": 4, "micro_batch_size": 1}


@pytest.mark.parametrize("pattern,layout", [(pattern, layout) for pattern in EXAMPLES for layout in LAYOUTS
                                            if layout != "ep2" or "E" in pattern])
def test_megatrons_example_patterns_train_as_one_process(pattern, layout):
    values = _example(pattern)
    results = run_on_ranks(2, train_and_collect, {**values, **LAYOUTS[layout]}, 2)
    assert_run_matches(results, reference(values), rel=1e-5, tensor_rel=1e-5)


def test_uneven_and_virtual_stages_of_a_pattern_train_as_one_process():
    """Chunks of 1, 2, 1 and 2 layers: two virtual stages per pipeline rank, the MoE layer on the last."""
    values = {**_example("*-*-|*-*E"), "hybrid_layer_pattern": "*-|*-*-|*-|*-*E"}
    results = run_on_ranks(2, train_and_collect, {**values, "pipeline_model_parallel_size": 2}, 2)
    assert_run_matches(results, reference({**values, "hybrid_layer_pattern": "*-*-*-*-*-*E"}), rel=1e-5,
                       tensor_rel=1e-5)


@pytest.mark.parametrize("values,message", [
    ({"hybrid_layer_pattern": "D-D-"}, r"'D-D-': D \(DeepSeek sparse attention\) layers are not built by this "
                                       r"version"),
    ({"hybrid_layer_pattern": "M-G*-"}, r"each mixer \(\* \+ G\) must be followed by its MLP"),
    ({"hybrid_layer_pattern": "*-**-"}, r"each mixer \(\* \+ G\) must be followed by its MLP"),
    ({"hybrid_layer_pattern": "*-x-"}, r"'x' is not a layer symbol"),
    ({"hybrid_layer_pattern": "*E*E"}, r"has MoE layers \(E\): give --num-experts"),
    ({"hybrid_layer_pattern": "*-*-", "num_layers": 3}, r"--num-layers 3 disagrees .* 2 layers \(4 symbols\)"),
    ({"hybrid_layer_pattern": "*-*E", "num_experts": 4, "moe_layer_freq": 1}, r"--moe-layer-freq 1 disagrees"),
    ({"hybrid_layer_pattern": "*-*-/*-", "mtp_num_layers": 2}, r"--mtp-num-layers 2 disagrees .* 1 prediction"),
    ({"hybrid_layer_pattern": "*-*-/*-/*E", "num_experts": 4}, r"the multi-token prediction depths are alike"),
    ({"hybrid_layer_pattern": "*-+-"}, r"mixes softmax attention \(\*\) and multi-latent attention \(\+\)"),
    ({"hybrid_layer_pattern": "*-|*-|*-", "pipeline_model_parallel_size": 2},
     r"has 3 pipeline segments \(\|\); with --pipeline-model-parallel-size 2"),
    ({"hybrid_layer_pattern": "*-|*-", "pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 1},
     r"--decoder-first-pipeline-num-layers cannot be combined with --hybrid-layer-pattern"),
    ({"hybrid_layer_pattern": "*-||*-"}, r"every pipeline segment between \| needs a layer"),
])
def test_a_pattern_that_cannot_be_built_or_disagrees_with_a_flag_is_one_line(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config({"model_preset": "llama-tiny", "mock_data": True, **values}, 2)


def test_a_prediction_depth_of_several_layers_is_built_counted_and_refused_by_hugging_face_in_one_line():
    """"*-*-/*-*-/*-*-": each of the two depths holds two layers, numbered after the decoder's depth by depth; the
    planner's parameter shapes are the built model's; no Hugging Face family stores such a depth."""
    from megatron_lite.config.layer_split import model_chunk_plans
    from megatron_lite.hf.configs import ConversionError
    from megatron_lite.hf.weights import hf_shapes
    from megatron_lite.planning.state_memory import chunk_params

    values = {k: v for k, v in TINY_2_LAYERS.items() if k != "num_layers"}
    config = make_config({**values, "hybrid_layer_pattern": "*-*-/*-*-/*-*-"})
    assert config.model.mtp_num_layers == 2
    model = build_model_chunk(config, ParallelState.single())
    names = [name for name, _ in model.named_global_parameters()]
    assert "mtp.layers.1.transformer_layers.1.mlp.linear_fc2.weight" in names
    assert [layer.layer_number for depth in model.mtp.layers for layer in depth.depth_layers] == [2, 3, 4, 5]
    assert [s.numel for s in chunk_params(config, model_chunk_plans(config, 0)[0])] == \
        [p.numel() for p in model.parameters()]
    with pytest.raises(ConversionError, match="multi-token prediction depths of 2 layers are not stored"):
        hf_shapes("deepseek_v3", config.model)
