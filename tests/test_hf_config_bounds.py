"""A config.json value out of its range is one line naming the key and value the user wrote and what would be
valid, for every numeric key the readers map, never a message about the flags the conversion would make."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config.arguments import make_config
from megatron_lite.hf.config_bounds import FRACTIONS, INTEGER_MINIMUMS, NON_NEGATIVE_NUMBERS, POSITIVE_NUMBERS
from megatron_lite.hf.configs import ConversionError
from megatron_lite.hf.families import model_values_from_hf

PRESETS = ("deepseek-v3", "qwen3-next-80b-a3b", "gpt-oss-20b", "mixtral-tiny", "qwen3-30b-a3b", "gpt2-124m",
           "nemotron-h-8b", "nemotron-3-nano-30b-a3b", "nemotron-3-super-120b-a12b")


def published(preset: str) -> dict:
    from megatron_lite.hf.families import hf_config_from_model

    return hf_config_from_model(make_config({"model_preset": preset, "mock_data": True}).model, torch.bfloat16)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_numeric_key_out_of_range_is_named_with_its_value(preset):
    hf = published(preset)
    model_values_from_hf(hf)  # the published config converts
    nested = [(hf[key], key) for key in ("rope_parameters", "rope_scaling") if isinstance(hf.get(key), dict)]
    checked = 0
    for record, where in [(hf, None), *nested]:
        for key in [k for k in record if k in INTEGER_MINIMUMS or k in (*POSITIVE_NUMBERS, *NON_NEGATIVE_NUMBERS,
                                                                          *FRACTIONS)]:
            bad = INTEGER_MINIMUMS[key] - 1 if key in INTEGER_MINIMUMS else (-1.0 if key not in FRACTIONS else 1.5)
            changed = {**record, key: bad}
            with pytest.raises(ConversionError) as error:
                model_values_from_hf(changed if where is None else {**hf, where: changed})
            assert f"'{key}' is {bad}; it must " in str(error.value), (key, str(error.value))
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("change, message", [
    ({"first_k_dense_replace": 70}, "config.json: 'first_k_dense_replace' is 70, more than the 61 layers "
                                    "('num_hidden_layers'); it must be at most 61"),
    ({"kv_lora_rank": -32}, "config.json: 'kv_lora_rank' is -32; it must be at least 1"),
    ({"n_group": 3}, "config.json: 'n_group' (3) must divide 'n_routed_experts' (256)"),
    ({"topk_group": 9}, "config.json: 'topk_group' (9) must not exceed 'n_group' (8)"),
    ({"num_experts_per_tok": 300}, "config.json: 'num_experts_per_tok' (300) must not exceed 'n_routed_experts' "
                                   "(256)"),
])
def test_deepseek_keys_that_disagree_are_named_as_the_user_wrote_them(change, message):
    with pytest.raises(ConversionError) as error:
        model_values_from_hf({**published("deepseek-v3"), **change})
    assert str(error.value) == message


def test_a_qwen3_next_every_zeroth_layer_is_a_line_not_a_division_by_zero():
    with pytest.raises(ConversionError, match="'decoder_sparse_step' is 0; it must be at least 1"):
        model_values_from_hf({**published("qwen3-next-80b-a3b"), "decoder_sparse_step": 0})
    with pytest.raises(ConversionError, match=r"'mlp_only_layers' names \[48\], not layers of the 48"):
        model_values_from_hf({**published("qwen3-next-80b-a3b"), "mlp_only_layers": [48]})
