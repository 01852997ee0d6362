"""gpt-oss (transformers' gpt_oss): biases in every linear (the router's and the experts' too), a learned sink per
head, sliding windows on alternate layers, YaRN without rounding its band, and the clamped gated unit. Random tiny
models (with and without YaRN, all layers windowed or alternating) convert to ours with transformers' logits in one
process, at TP2 x PP2 and at EP2 x TP2 (with greedy ids); greedy generation with the KV cache equals `generate`;
HF -> ours -> HF is tensor-identical; the presets have the published parameter counts; an MoE with expert biases
trains as one process at EP2 with expert TP2 and folded; the planner and the model FLOPs count what the model
builds and does; what cannot be converted exactly is one line."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from tests.harness import run_on_ranks
from tests.helpers import HF_VOCAB, assert_run_matches, convert, join_shards, random_hf_checkpoint
from tests.test_hf_conversion import (
    SEQ,
    _ep2_tp2,
    _tp2_pp2,
    assert_ranks_give_transformers_logits_and_greedy_ids,
    assert_same_safetensors,
    assert_tp2_pp2_results_are_transformers,
    hf_logits,
    our_logits,
    read_text,
    run_case,
)
from tests.test_window_and_sinks import GPT_OSS_LIKE
from tests.tolerances import assert_close_relative

# gpt-oss's YaRN, which does not round its band (truncate: false), from a 32-token context: rounding would move the
# second frequency of the 16-dimensional heads here from 0.026 to 0.12
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 32, "truncate": False}
VARIANTS = {
    "alternating_windows_yarn": dict(layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=YARN),
    "all_windows_plain_rope": dict(layer_types=["sliding_attention"] * 4,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def hf_config(variant: str):
    import transformers

    return transformers.GptOssConfig(
        vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=HF_VOCAB - 1, swiglu_limit=0.5,
        router_aux_loss_coef=0.0, **VARIANTS[variant])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{variant: (HF directory, converted megatron_lite directory)}: biases away from 0 (the experts' too), norms
    from 1, and sinks that take a share of each softmax."""
    return {variant: random_hf_checkpoint(hf_config(variant), tmp_path_factory.mktemp(variant), index, ("sinks",))
            for index, variant in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def converted(models) -> tuple[str, str]:
    return models["alternating_windows_yarn"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_converted_model_has_transformers_logits(models, variant):
    hf_dir, mlite_dir = models[variant]
    ids = torch.randint(0, HF_VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))  # past 6-token windows
    assert_close_relative(our_logits(mlite_dir, ids), hf_logits(hf_dir, ids), rel=1e-5)


def test_the_converted_gpt_oss_has_megatrons_flags(converted):
    """The flags Megatron-LM's gpt-oss recipe passes (window 127 for sliding_window 128)."""
    flags = yaml.safe_load(read_text(os.path.join(converted[1], "model.yaml")))
    assert flags["window_size"] == [5, 0] and flags["window_attn_skip_freq"] == "[1,0,1,0]"
    assert flags["softmax_type"] == "learnable" and not flags.get("disable_bias_linear")
    assert flags["quick_geglu"] and flags["glu_linear_offset"] == 1.0 and flags["activation_func_clamp_value"] == 0.5
    assert flags["position_embedding_type"] == "yarn" and flags["yarn_correction_range_round_to_int"] is False
    assert flags["rotary_scaling_factor"] == 32.0 and flags["yarn_original_max_position_embeddings"] == 32


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_to_mlite_to_hf_is_tensor_identical(models, variant, tmp_path):
    hf_dir, mlite_dir = models[variant]
    convert("--direction", "mlite-to-hf", "--load-dir", mlite_dir, "--save-dir", str(tmp_path / "back"))
    assert_same_safetensors(hf_dir, str(tmp_path / "back"))
    ids = torch.randint(0, HF_VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    assert torch.equal(hf_logits(str(tmp_path / "back"), ids), hf_logits(hf_dir, ids))  # its config.json too


def test_greedy_generation_with_windows_and_sinks_equals_transformers_generate(converted):
    from megatron_lite.inference.generation import generate
    from megatron_lite.inference.sampling_params import SamplingParams
    from tests.test_generation import our_model, transformers_greedy

    hf_dir, mlite_dir = converted
    prompt = torch.randint(0, HF_VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    ours = generate(our_model(mlite_dir), prompt, 12, SamplingParams(greedy=True))
    assert torch.equal(ours, transformers_greedy(hf_dir, prompt, 12))


def test_the_converted_model_at_tp2_pp2_gives_transformers_logits_and_loss(converted):
    hf_dir, mlite_dir = converted
    ids = torch.randint(0, HF_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    last_stage = run_on_ranks(4, _tp2_pp2, {"gpt_oss": run_case(mlite_dir)}, ids)[-1]
    assert_tp2_pp2_results_are_transformers(last_stage, {"gpt_oss": hf_dir}, ids)


def test_the_converted_model_at_ep2_tp2_gives_transformers_logits_and_greedy_ids(converted):
    """The experts' fc2 biases are added by one expert-tensor-parallel rank of two."""
    hf_dir, mlite_dir = converted
    ids = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    per_rank = run_on_ranks(4, _ep2_tp2, {"gpt_oss": run_case(mlite_dir)}, ids, 6)
    assert_ranks_give_transformers_logits_and_greedy_ids(per_rank, "gpt_oss", hf_dir, ids, 6)


# gpt-oss's network, tiny: biased linears (router and experts included), sinks, alternating windows, YaRN unrounded,
# the clamped quick-GELU unit (a clamp the activations reach), documents packed into the sequences
GPT_OSS_MOE = {**GPT_OSS_LIKE, "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
               "activation_func_clamp_value": 0.5, "position_embedding_type": "yarn", "rotary_scaling_factor": 8.0,
               "yarn_original_max_position_embeddings": 8, "yarn_correction_range_round_to_int": False,
               "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": 0.01}
EXPERT_LAYOUTS = {  # on 4 ranks, attention at TP2 + SP
    "ep2_etp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2},
    "ep2_etp1_folded": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                        "expert_tensor_parallel_size": 1},
}


def _run(values: dict, world_size: int) -> tuple:
    """((losses, final weights, last gradients), gradient norms) of training `values`."""
    from tests.helpers import parameter_records, pretrain_keeping_chunks

    history, chunks = pretrain_keeping_chunks(values, world_size)
    return (([h["lm_loss"] for h in history], parameter_records(chunks, lambda p: p),
             parameter_records(chunks, lambda p: p.main_grad)), [h["grad_norm"] for h in history])


def _train_expert_layouts() -> dict:
    return {name: _run({**GPT_OSS_MOE, **flags}, 4) for name, flags in EXPERT_LAYOUTS.items()}


def test_an_moe_with_expert_biases_trains_as_one_process_at_ep2_with_etp2_and_folded():
    """Losses, gradient norms (each replicated fc2 bias counted once), final weights and last gradients of every
    expert bias equal one process's: fc2's bias is added by one ETP rank and its gradient is whole on each."""
    expected, norms = _run(GPT_OSS_MOE, 1)
    per_rank = run_on_ranks(4, _train_expert_layouts)
    for name in EXPERT_LAYOUTS:
        assert_run_matches([runs[name][0] for runs in per_rank], expected, rel=1e-5, tensor_rel=1e-4)
        for runs in per_rank:
            assert runs[name][1] == pytest.approx(norms, rel=1e-5), name
    bias_grads = [grad for (name, _), grad in join_shards([expected[2]]).items() if ".experts." in name
                  and name.endswith("bias")]
    assert len(bias_grads) == 4 * 4 * 2 and all(grad.abs().max() > 0 for grad in bias_grads)


def test_the_planner_counts_the_expert_and_router_biases_each_rank_builds():
    """Parameter shapes in module order at TP2 = ETP2 (fc1's bias split with its rows, fc2's whole)."""
    import pretrain_gpt
    from megatron_lite.config.arguments import make_config
    from megatron_lite.config.layer_split import model_chunk_plans
    from megatron_lite.parallel.state import Layout, ParallelState
    from megatron_lite.planning.state_memory import chunk_params

    config = make_config({**GPT_OSS_MOE, "tensor_model_parallel_size": 2, "sequence_parallel": True}, 2)
    (plan,) = model_chunk_plans(config, 0)
    model = pretrain_gpt.model_provider(config, ParallelState.without_groups(Layout.from_world(2, tp=2), 0), plan,
                                        torch.device("cpu"))
    shapes = chunk_params(config, plan)
    assert [shape.numel for shape in shapes] == [p.numel() for p in model.parameters()]
    biases = [(shape, name) for shape, (name, _) in zip(shapes, model.named_parameters()) if name.endswith("bias")]
    assert all(not shape.muon for shape, _ in biases) and any(".experts." in name for _, name in biases)


# openai/gpt-oss-20b's and -120b's config.json: the keys that shape the network
_PUBLISHED_COMMON = {"model_type": "gpt_oss", "attention_bias": True, "head_dim": 64, "hidden_act": "silu",
                     "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072,
                     "num_attention_heads": 64, "num_experts_per_tok": 4, "num_key_value_heads": 8,
                     "rms_norm_eps": 1e-5, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                            "original_max_position_embeddings": 4096,
                                                            "rope_type": "yarn", "truncate": False},
                     "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
                     "vocab_size": 201088}
PUBLISHED = {
    "gpt-oss-20b": {**_PUBLISHED_COMMON, "num_hidden_layers": 24, "num_local_experts": 32,
                    "layer_types": ["sliding_attention", "full_attention"] * 12},
    "gpt-oss-120b": {**_PUBLISHED_COMMON, "num_hidden_layers": 36, "num_local_experts": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 18},
}
# (total, activated): transformers' counts of the configs above (GptOssForCausalLM on the meta device); OpenAI's
# figures are 21B and 3.6B, 117B and 5.1B, activated without the input embedding
COUNTS = {"gpt-oss-20b": (20_914_757_184, 4_187_440_704), "gpt-oss-120b": (116_829_156_672, 5_711_982_912)}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_shapes_and_parameter_counts(preset):
    from megatron_lite.config.arguments import make_config
    from megatron_lite.config.layer_pattern import window_attention_pattern
    from megatron_lite.config.presets import MODEL_PRESETS
    from megatron_lite.hf.families import model_values_from_hf
    from megatron_lite.hf.weights import hf_shapes

    published = make_config({**model_values_from_hf(PUBLISHED[preset]), "mock_data": True, "seq_length": 4096}).model
    m = make_config({"model_preset": preset, "mock_data": True}).model
    for key in MODEL_PRESETS[preset]:
        if key not in ("seq_length", "window_attn_skip_freq", "moe_aux_loss_coeff"):
            assert getattr(m, key) == getattr(published, key), key
    assert window_attention_pattern(m) == window_attention_pattern(published) == [True, False] * (m.num_layers // 2)
    shapes = {name: torch.Size(shape).numel() for name, shape in hf_shapes("gpt_oss", m).items()}
    total, activated = COUNTS[preset]
    assert sum(shapes.values()) == total
    routed = sum(n for name, n in shapes.items() if ".mlp.experts." in name)
    assert total - routed * (1 - m.moe_router_topk / m.num_experts) == activated


def test_model_flops_count_the_keys_a_window_lets_a_query_see():
    """The forward's matrix products as torch's FLOP counter sees them, with each attention's keys from the
    definition: a windowed layer's query sees LEFT + 1 = 6 keys of the 32, a full layer's all 32 (the attention
    of sinks materialises its scores whole, so the counter sees 32 keys in every layer)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.config.arguments import make_config
    from megatron_lite.model.flops import training_flops_per_token
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.state import ParallelState

    dense = {key: value for key, value in GPT_OSS_MOE.items() if not key.startswith(("num_experts", "moe_"))}
    m = make_config({**dense, "reset_attention_mask": False}).model
    model = GPTModel(m, ParallelState.single(), padded_vocab=m.vocab_size, seed=1)
    s, heads_dims = m.seq_length, m.num_attention_heads * m.head_dim
    ids = torch.randint(0, m.vocab_size, (2, s))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, torch.arange(s), labels=ids)
    windowed, full = 2, 2
    counted = counter.get_total_flops() / (2 * s) - (windowed + full) * 4 * s * heads_dims
    counted += windowed * 4 * (m.window_size[0] + 1) * heads_dims + full * 4 * s * heads_dims
    assert training_flops_per_token(m) / 3 == pytest.approx(counted, rel=1e-12)


@pytest.mark.parametrize("change,message", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, r"experts are quantized \(mxfp4\); dequantize the checkpoint "
                                                         r"to bf16 first"),
    ({"swiglu_alpha": 1.5}, r"a swiglu_alpha \(1.5\) other than 1.702 is not supported"),
    ({"attention_bias": False}, "a gpt_oss without attention biases is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types .* is not supported"),
])
def test_gpt_oss_configs_that_cannot_be_converted_exactly_are_one_line(change, message):
    from megatron_lite.hf.configs import ConversionError
    from megatron_lite.hf.families import model_values_from_hf

    with pytest.raises(ConversionError, match=message) as error:
        model_values_from_hf({**PUBLISHED["gpt-oss-20b"], "num_hidden_layers": 2, **change})
    assert "\n" not in str(error.value)


def test_a_network_gpt_oss_cannot_hold_is_refused_on_export_in_one_line():
    from megatron_lite.config.arguments import make_config
    from megatron_lite.hf.configs import ConversionError
    from megatron_lite.hf.families import family_of_model

    m = make_config({**GPT_OSS_MOE, "softmax_type": "vanilla", "disable_bias_linear": True}).model
    with pytest.raises(ConversionError, match=r"gpt_oss \(the one with --window-size, --quick-geglu, "
                                              r"--glu-linear-offset, --activation-func-clamp-value\) needs biases "
                                              r"\(no --disable-bias-linear\) and --softmax-type learnable"):
        family_of_model(m)
    assert family_of_model(make_config(GPT_OSS_MOE).model) == "gpt_oss"
