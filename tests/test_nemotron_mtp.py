"""Nemotron 3's multi-token prediction depths in its Hugging Face files (transformers 5 builds no such depth and
drops them): a checkpoint that holds them converts into our MTP depths and back tensor for tensor, MTP included; the
export loads in transformers with the original's logits; the keys a config.json names its depths with read alike;
the Nemotron 3 Super preset's files have the published checkpoint's tensors and elements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from megatron_lite.config.arguments import make_config
from megatron_lite.hf.families import model_values_from_hf
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState
from tests.helpers import HF_VOCAB, convert, hf_models

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _with_published_mtp_depths(hf_dir: str, target: Path, depth_pattern: str, depths: int) -> dict:
    """A copy of transformers' saved nemotron_h_latent directory (blocks M, *, E) with `depths` prediction depths of
    the blocks `depth_pattern`, stored as NVIDIA publishes them (Megatron-Bridge's names): the blocks of all depths
    numbered on from 0 under mtp.layers, each a decoder block's tensors of its kind, a depth's first block also
    holding enorm, hnorm and eh_proj [h, 2h], its last the final norm; all random. Returns the tensors."""
    import shutil

    shutil.copytree(hf_dir, target)
    config = json.loads((target / "config.json").read_text())
    tensors = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(7)
    h, decoder_block = config["hidden_size"], {"M": 0, "*": 1, "E": 2}
    for depth in range(depths):
        first = depth * len(depth_pattern)
        for offset, symbol in enumerate(depth_pattern):
            source, stored = f"backbone.layers.{decoder_block[symbol]}.", f"mtp.layers.{first + offset}."
            for name, tensor in list(tensors.items()):
                if name.startswith(source):
                    tensors[stored + name[len(source):]] = torch.randn(tensor.shape, generator=generator)
        last = f"mtp.layers.{first + len(depth_pattern) - 1}."
        tensors |= {f"mtp.layers.{first}.enorm.weight": torch.rand(h, generator=generator) + 0.5,
                    f"mtp.layers.{first}.hnorm.weight": torch.rand(h, generator=generator) + 0.5,
                    f"mtp.layers.{first}.eh_proj.weight": torch.randn(h, 2 * h, generator=generator) * 0.02,
                    last + "final_layernorm.weight": torch.rand(h, generator=generator) + 0.5}
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config |= {"num_nextn_predict_layers": depths, "mtp_hybrid_override_pattern": depth_pattern}
    config.pop("mtp_layers_block_type", None)
    (target / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("depth_pattern,depths,our_layer", [
    ("*E", 1, "mtp.layers.0.transformer_layer.mlp.fc1_latent_proj"),  # Nemotron 3 Super's: one depth, one layer
    ("M*E", 2, "mtp.layers.1.transformer_layers.1.self_attention.linear_qkv.weight"),  # two depths of two layers
])
def test_published_mtp_depths_convert_into_ours_and_back_tensor_identical(tmp_path_factory, tmp_path, depth_pattern,
                                                                         depths, our_layer):
    hf_dir, _ = hf_models(tmp_path_factory)["nemotron_h_latent"]
    original = _with_published_mtp_depths(hf_dir, tmp_path / "hf", depth_pattern, depths)
    convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mlite"))
    flags = yaml.safe_load((tmp_path / "mlite" / "model.yaml").read_text())
    assert flags["hybrid_layer_pattern"] == "M*E" + f"/{depth_pattern}" * depths
    config = make_config({**flags, "mock_data": True})
    assert config.model.mtp_num_layers == depths
    names = dict(GPTModel(config.model, ParallelState.single(), padded_vocab=HF_VOCAB, seed=1)
                 .named_global_parameters())
    assert our_layer in names
    convert("--direction", "mlite-to-hf", "--load-dir", str(tmp_path / "mlite"), "--save-dir", str(tmp_path / "back"))
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (exported["num_nextn_predict_layers"], exported["mtp_hybrid_override_pattern"]) == (depths, depth_pattern)


def test_the_export_with_mtp_depths_loads_in_transformers_with_the_originals_logits(tmp_path_factory, tmp_path):
    """transformers reads the exported config.json (its MTP keys included) and leaves the depths' tensors out."""
    from transformers import AutoModelForCausalLM

    hf_dir, _ = hf_models(tmp_path_factory)["nemotron_h_latent"]
    _with_published_mtp_depths(hf_dir, tmp_path / "hf", "*E", 1)
    convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mlite"))
    convert("--direction", "mlite-to-hf", "--load-dir", str(tmp_path / "mlite"), "--save-dir", str(tmp_path / "back"))
    ids = torch.randint(0, HF_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
        actual = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()(ids).logits
    assert torch.equal(actual, expected)


def test_the_depths_read_alike_from_each_form_of_the_config():
    """mtp_hybrid_override_pattern (NVIDIA's), mtp_layers_block_type (what transformers 5 saves), and neither
    (transformers' default, an attention and an MoE block); a file without depths has no /."""
    base = {"model_type": "nemotron_h", "hidden_size": 64, "vocab_size": 300, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "mamba_num_heads": 8,
            "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "hybrid_override_pattern": "M*E",
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 48}
    forms = [{"mtp_hybrid_override_pattern": "*E"}, {"mtp_layers_block_type": ["full_attention", "moe"]}, {}]
    for form in forms:
        values = model_values_from_hf({**base, "num_nextn_predict_layers": 2, **form})
        assert values["hybrid_layer_pattern"] == "M*E/*E/*E", form
    assert model_values_from_hf({**base, "num_nextn_predict_layers": 0})["hybrid_layer_pattern"] == "M*E"


def test_the_super_presets_files_hold_the_published_checkpoints_tensors():
    """Megatron-Bridge's export of nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 reproduces 42,683 tensors of
    123,611,033,088 elements; the preset's files have as many, its MTP depth as two blocks under mtp.layers."""
    from megatron_lite.hf.weights import hf_shapes

    shapes = hf_shapes("nemotron_h", make_config({"model_preset": "nemotron-3-super-120b-a12b",
                                                  "mock_data": True}).model)
    assert (len(shapes), sum(torch.Size(shape).numel() for shape in shapes.values())) == (42_683, 123_611_033_088)
    assert {name.split(".")[2] for name in shapes if name.startswith("mtp.")} == {"0", "1"}
    assert shapes["mtp.layers.0.eh_proj.weight"] == (4096, 8192)
    assert shapes["mtp.layers.1.mixer.fc1_latent_proj.weight"] == (1024, 4096)


def test_a_transformers_saved_file_naming_depths_it_lacks_converts_without_them(tmp_path_factory, tmp_path, capfd):
    """transformers saves a Nemotron 3 model's config with its MTP keys but none of the depths' tensors: the
    conversion says so and converts the decoder alone, as it does DeepSeek-V3's."""
    import shutil

    hf_dir, _ = hf_models(tmp_path_factory)["nemotron_h_latent"]
    shutil.copytree(hf_dir, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config |= {"num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mlite"))
    assert "names 1 multi-token prediction module(s)" in capfd.readouterr().err
    assert yaml.safe_load((tmp_path / "mlite" / "model.yaml").read_text())["hybrid_layer_pattern"] == "M*E"
