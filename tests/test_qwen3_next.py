"""Qwen3-Next (transformers' qwen3_next): Gated DeltaNet layers between gated softmax-attention layers with
partial RoPE and zero-centred norms, a dense first layer and MoE layers with a gated shared expert; and Qwen3.5's
text models, dense (qwen3_5_text) and MoE (qwen3_5_moe_text), the same network stored otherwise. Random tiny models
convert to ours with transformers' logits in one process, Qwen3-Next's also at TP2 x PP2 (a stage holds both kinds
of layer) and at EP2 x TP2 (with greedy ids), and HF -> ours -> HF is tensor-identical."""

from __future__ import annotations

import json
import os

import pytest
import torch
import yaml

from tests.harness import run_on_ranks
from tests.helpers import HF_VOCAB, convert, perturb_biases_and_norms, random_hf_checkpoint
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
from tests.tolerances import assert_close_relative

FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
QWEN3_5_VL = {"qwen3_5": ("qwen3_5_text", "Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
              "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration")}


def hf_config(family: str):
    import transformers

    shape = dict(vocab_size=HF_VOCAB, hidden_size=64, num_hidden_layers=4, max_position_embeddings=64,
                 bos_token_id=0, eos_token_id=HF_VOCAB - 1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                 rms_norm_eps=1e-6, tie_word_embeddings=False)
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    return {"qwen3_next": lambda: transformers.Qwen3NextConfig(**shape, **experts, intermediate_size=96,
                                                               mlp_only_layers=[0]),
            "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**shape, intermediate_size=96),
            "qwen3_5_moe_text": lambda: transformers.Qwen3_5MoeTextConfig(**shape, **experts)}[family]()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{family: (HF directory, converted megatron_lite directory)}: the zero-centred norms' weights away from 0,
    the output norms' from 1, and the decays' parameters moved."""
    return {family: random_hf_checkpoint(hf_config(family), tmp_path_factory.mktemp(family), index,
                                         ("A_log", "dt_bias"), 0.3) for index, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def converted(models) -> tuple[str, str]:
    return models["qwen3_next"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_converted_model_has_transformers_logits(models, family):
    hf_dir, mlite_dir = models[family]
    ids = torch.randint(0, HF_VOCAB, (2, 80), generator=torch.Generator().manual_seed(1))  # over one 64-token chunk
    assert_close_relative(our_logits(mlite_dir, ids), hf_logits(hf_dir, ids), rel=1e-5)


def test_the_converted_qwen3_next_has_its_flags(converted):
    hf_dir, mlite_dir = converted
    flags = yaml.safe_load(read_text(os.path.join(mlite_dir, "model.yaml")))
    assert flags["experimental_attention_variant"] == "gated_delta_net"
    assert flags["linear_attention_freq"] == "[1,0,1,0]" and flags["moe_layer_freq"] == "[0,1,1,1]"
    assert flags["rotary_percent"] == 0.25 and flags["apply_layernorm_1p"] and flags["attention_output_gate"]


def test_the_converted_model_at_tp2_pp2_gives_transformers_logits_and_loss(converted):
    hf_dir, mlite_dir = converted
    ids = torch.randint(0, HF_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    last_stage = run_on_ranks(4, _tp2_pp2, {"qwen3_next": run_case(mlite_dir)}, ids)[-1]
    assert_tp2_pp2_results_are_transformers(last_stage, {"qwen3_next": hf_dir}, ids)


def test_the_converted_model_at_ep2_tp2_gives_transformers_logits_and_greedy_ids(converted):
    hf_dir, mlite_dir = converted
    ids = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    per_rank = run_on_ranks(4, _ep2_tp2, {"qwen3_next": run_case(mlite_dir)}, ids, 6)
    assert_ranks_give_transformers_logits_and_greedy_ids(per_rank, "qwen3_next", hf_dir, ids, 6)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_mlite_to_hf_is_tensor_identical(models, family, tmp_path):
    hf_dir, mlite_dir = models[family]
    convert("--direction", "mlite-to-hf", "--load-dir", mlite_dir, "--save-dir", str(tmp_path / "back"))
    assert_same_safetensors(hf_dir, str(tmp_path / "back"))
    ids = torch.randint(0, HF_VOCAB, (1, 20), generator=torch.Generator().manual_seed(3))
    assert torch.equal(hf_logits(str(tmp_path / "back"), ids), hf_logits(hf_dir, ids))  # its config.json too


@pytest.mark.parametrize("family", QWEN3_5_VL)
def test_a_qwen3_5_vision_language_checkpoint_converts_its_language_model(family, tmp_path, capfd):
    """Qwen3.5 as published: the vision-language model, whose language model converts (the vision tower is left out
    with a note); our logits equal the VL model's on text, and the export is the text model, with the same logits."""
    import transformers

    text_family, config_class, model_class = QWEN3_5_VL[family]
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(7)
    config = getattr(transformers, config_class)(text_config=hf_config(text_family).to_dict(), vision_config=vision)
    model = getattr(transformers, model_class)(config)
    perturb_biases_and_norms(model)
    model.save_pretrained(tmp_path / "hf")
    convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mlite"))
    assert "the vision tower's" in capfd.readouterr().err
    ids = torch.randint(0, HF_VOCAB, (2, 30), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        reference = model.eval()(ids).logits
    assert_close_relative(our_logits(str(tmp_path / "mlite"), ids), reference, rel=1e-5)
    convert("--direction", "mlite-to-hf", "--load-dir", str(tmp_path / "mlite"), "--save-dir", str(tmp_path / "back"))
    assert json.loads(read_text(str(tmp_path / "back" / "config.json")))["model_type"] == text_family
    assert_close_relative(hf_logits(str(tmp_path / "back"), ids), reference, rel=1e-5)


def test_greedy_generation_with_the_recurrent_state_equals_transformers_generate(converted):
    """Our generation keeps each Gated DeltaNet layer's state and convolution inputs beside the KV cache of the
    softmax layers; transformers' generate keeps its own cache: the same ids."""
    from megatron_lite.inference.generation import generate
    from megatron_lite.inference.sampling_params import SamplingParams
    from tests.test_generation import our_model, transformers_greedy

    hf_dir, mlite_dir = converted
    prompt = torch.randint(0, HF_VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    ours = generate(our_model(mlite_dir), prompt, 12, SamplingParams(greedy=True))
    assert torch.equal(ours, transformers_greedy(hf_dir, prompt, 12))


def test_decoding_with_the_recurrent_state_equals_the_full_forward(converted):
    from tests.test_generation import assert_cached_decoding_equals_full_forward, our_model

    assert_cached_decoding_equals_full_forward(our_model(converted[1]))


# The published configs (Qwen/Qwen3-Next-80B-A3B, the text configs of Qwen/Qwen3.5-9B and Qwen/Qwen3.5-35B-A3B):
# the keys that shape the network
_PUBLISHED_COMMON = {"hidden_act": "silu", "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
                     "full_attention_interval": 4, "num_attention_heads": 16, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": False, "max_position_embeddings": 262144, "router_aux_loss_coef": 0.001,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}
_PUBLISHED_MOE = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
PUBLISHED = {
    "qwen3-next-80b-a3b": {**_PUBLISHED_COMMON, **_PUBLISHED_MOE, "model_type": "qwen3_next", "hidden_size": 2048,
                           "intermediate_size": 5120, "num_hidden_layers": 48, "num_key_value_heads": 2,
                           "vocab_size": 151936, "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
                           "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen3.5-9b": {**_PUBLISHED_COMMON, "model_type": "qwen3_5_text", "hidden_size": 4096, "intermediate_size": 12288,
                   "num_hidden_layers": 32, "num_key_value_heads": 4, "vocab_size": 248320},
    "qwen3.5-35b-a3b": {**_PUBLISHED_COMMON, **_PUBLISHED_MOE, "model_type": "qwen3_5_moe_text", "hidden_size": 2048,
                        "num_hidden_layers": 40, "num_key_value_heads": 2, "vocab_size": 248320, "num_experts": 256,
                        "num_experts_per_tok": 8},
}
# (total, activated): transformers' counts of the configs above (the models' own classes, on the meta device);
# Qwen3-Next's published figures are 80B and 3B, Qwen3.5's 9B and 35B-A3B
COUNTS = {"qwen3-next-80b-a3b": (79_674_391_296, 3_874_929_408), "qwen3.5-9b": (8_953_803_264, 8_953_803_264),
          "qwen3.5-35b-a3b": (34_660_610_688, 3_454_988_928)}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_shapes_and_parameter_counts(preset):
    from megatron_lite.config.arguments import make_config
    from megatron_lite.config.layer_pattern import linear_attention_pattern, moe_layer_pattern
    from megatron_lite.config.presets import MODEL_PRESETS
    from megatron_lite.hf.families import model_values_from_hf
    from megatron_lite.hf.weights import hf_shapes

    published = make_config({**model_values_from_hf(PUBLISHED[preset]), "mock_data": True, "seq_length": 4096}).model
    m = make_config({"model_preset": preset, "mock_data": True}).model
    for key in MODEL_PRESETS[preset]:
        if key not in ("seq_length", "linear_attention_freq", "moe_layer_freq", "kv_channels"):
            assert getattr(m, key) == getattr(published, key), key
    assert m.head_dim == published.head_dim == 256
    assert linear_attention_pattern(m) == linear_attention_pattern(published)
    assert moe_layer_pattern(m) == moe_layer_pattern(published)
    family = PUBLISHED[preset]["model_type"]
    shapes = {name: torch.Size(shape).numel() for name, shape in hf_shapes(family, m).items()}
    total, activated = COUNTS[preset]
    assert sum(shapes.values()) == total
    routed = sum(n for name, n in shapes.items() if ".mlp.experts." in name)
    assert total - routed * (1 - m.moe_router_topk / m.num_experts if m.num_experts else 0) == activated
