"""Checkpoints saved by an earlier version of the package (tests/fixtures/legacy_checkpoints: a dense, an MoE +
MTP, a hybrid and a gpt-oss-like model) load with the logits they were saved with, resume to the losses of the
run that saved them, and convert to Hugging Face models that give those logits."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.inference.generation import load_model
from megatron_lite.training.loop import pretrain
from tests.helpers import convert
from tests.tolerances import assert_close_relative

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "legacy_checkpoints")
MODELS = ("dense", "moe_mtp", "hybrid", "gpt_oss")


def _fixture(name: str, tmp_path) -> tuple[str, dict, torch.Tensor]:
    """A copy of the saved directory (loading and training write beside it), its record and its logits."""
    directory = str(tmp_path / name)
    shutil.copytree(os.path.join(FIXTURES, name), directory)
    with open(os.path.join(FIXTURES, f"{name}.json")) as f:
        record = json.load(f)
    logits = torch.load(os.path.join(FIXTURES, f"{name}_logits.pt"), weights_only=True)
    return directory, record, logits


def _inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(12).reshape(2, 6) * 7 % vocab_size, torch.arange(6)


@pytest.mark.parametrize("name", MODELS)
def test_a_checkpoint_saved_before_loads_resumes_and_converts(name, tmp_path):
    directory, record, saved_logits = _fixture(name, tmp_path)
    tokens, positions = _inputs(record["flags"]["vocab_size"])

    model, _ = load_model(os.path.join(directory, "iter_0000002"))
    with torch.no_grad():
        assert_close_relative(model(tokens, positions), saved_logits, msg=f"{name}: logits after loading")

    config = make_config({**record["flags"], "load": directory})
    losses = [h["lm_loss"] for h in pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)]
    assert losses == pytest.approx(record["losses_after_resume"], rel=1e-5), name

    from transformers import AutoModelForCausalLM

    convert("--direction", "mlite-to-hf", "--load-dir", os.path.join(directory, "iter_0000002"),
            "--save-dir", str(tmp_path / "hf"))
    hf_model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf_model(tokens, position_ids=positions.expand(2, -1)).logits
    assert_close_relative(hf_logits, saved_logits, rel=1e-4, msg=f"{name}: the Hugging Face export's logits")
