"""The YAML recipes under examples/ are valid configurations for the layouts their comments name."""

import glob
import os

import pytest

from megatron_lite.config.arguments import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"llama3_8b.yaml": 8, "llama3.2_1b_recipe.yaml": 8}  # file -> the world size it is written for


def test_every_recipe_is_listed():
    assert {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "examples", "*.yaml"))} == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_parses_and_validates(name):
    config = parse_config(["--config", os.path.join(ROOT, "examples", name), "--data-path", "corpus_text_document",
                           "--tokenizer-model", "tokenizer"], RECIPES[name])
    assert config.parallel.data_parallel_size >= 1


def test_the_llama_1b_recipe_packs_documents_ramps_up_the_batch_and_decays_wsd():
    config = parse_config(["--config", os.path.join(ROOT, "examples", "llama3.2_1b_recipe.yaml"), "--data-path", "c",
                           "--tokenizer-model", "t"], 8)
    d, o, t = config.data, config.optimizer, config.training
    assert d.reset_position_ids and d.reset_attention_mask and d.eod_mask_loss
    assert o.lr_decay_style == "WSD" and t.rampup_batch_size == [64, 64, 2000000] and config.logging.profile
    assert t.train_samples * config.model.seq_length == pytest.approx(50e9, rel=1e-6)
