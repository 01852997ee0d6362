"""Model families: --qk-layernorm, --add-qkv-bias, --kv-channels and Llama 3.1's RoPE scaling under tensor
parallelism, the scaled frequencies against transformers' formula, the llama3.2-1b, qwen3-0.6b, qwen3-30b-a3b and
qwen1.5-moe-a2.7b presets against the published configs, and one-line errors for what cannot be built. (Logits
and greedy ids of qwen2, qwen3, the Qwen MoE families and a rope-scaled llama against transformers are in
test_hf_conversion.py and test_generation.py.)"""

import pytest
import torch

from megatron_lite.config.arguments import make_config
from megatron_lite.config.presets import MODEL_PRESETS
from megatron_lite.errors import ConfigError
from megatron_lite.hf.families import model_values_from_hf
from megatron_lite.hf.weights import hf_shapes
from megatron_lite.model.attention.self_attention import RopeScaling, RotaryEmbedding
from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import run_on_ranks
from tests.helpers import SMALL, forward_backward
from tests.tolerances import assert_close_relative

# Every new attention feature at once, heads of 32 channels at hidden size 64 with 4 heads
FAMILY_MODEL = {**SMALL, "model_preset": "llama-tiny", "num_attention_heads": 4, "num_query_groups": 2,
                "ffn_hidden_size": 96, "kv_channels": 32, "qk_layernorm": True, "add_qkv_bias": True,
                "use_rope_scaling": True, "rope_scaling_original_max_position_embeddings": 16}
TP_LAYOUTS = [False, True]  # sequence parallelism off, on


def _tp2_cases() -> dict:
    pstate = ParallelState.build(Layout.from_world(2, tp=2))
    return {sp: forward_backward({**FAMILY_MODEL, "tensor_model_parallel_size": 2, "sequence_parallel": sp},
                                 pstate, 2) for sp in TP_LAYOUTS}


def test_tp2_with_qk_layernorm_qkv_bias_and_rope_scaling_matches_single_device():
    reference = forward_backward(FAMILY_MODEL, ParallelState.single(), 1)
    assert {"decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.k_layernorm.weight",
            "decoder.layers.0.self_attention.linear_qkv.bias"} <= reference["grads"].keys()
    for sp, got in run_on_ranks(2, _tp2_cases)[0].items():
        assert_close_relative(got["logits"], reference["logits"], rel=1e-5, msg=f"sp={sp}")
        for name, grad in reference["grads"].items():
            assert torch.equal(got["weights"][name], reference["weights"][name]), name
            assert grad.abs().max() > 0, name
            assert_close_relative(got["grads"][name], grad, rel=1e-5, msg=f"{name} sp={sp}")


def test_rope_scaling_frequencies_equal_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = make_config({"model_preset": "llama3.2-1b", "mock_data": True}).model
    hf = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = RotaryEmbedding(config.head_dim, config.rotary_base, RopeScaling.of(config)).inv_freq
    plain = RotaryEmbedding(config.head_dim, config.rotary_base).inv_freq
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert (ours == plain).any() and (ours == plain / 32).any() and ((ours < plain) & (ours > plain / 32)).any()


# The published config.json of each preset's model (the keys that decide its shapes)
PUBLISHED = {
    "llama3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    "tie_word_embeddings": True, "vocab_size": 128256},
    "llama3-70b": {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256},
    "llama3.1-405b": {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
                      "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
                      "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      "tie_word_embeddings": False, "vocab_size": 128256},
    "qwen3-0.6b": {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
                   "attention_bias": False, "use_sliding_window": False, "tie_word_embeddings": True,
                   "vocab_size": 151936},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                      "attention_bias": False, "use_sliding_window": False, "tie_word_embeddings": False,
                      "vocab_size": 151936, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "router_aux_loss_coef": 0.001},
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                          "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                          "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 151936,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                          "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
                          "mlp_only_layers": [], "router_aux_loss_coef": 0.001},
}
# With the tied embedding counted once; the MoE and large Llama models' are transformers' counts of the published
# configs (30.5B, 14.3B, 70.6B and 405.9B as published).
PARAMETERS = {"llama3.2-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920, "qwen3-30b-a3b": 30_532_122_624,
              "qwen1.5-moe-a2.7b": 14_315_784_192, "llama3-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_has_the_published_shapes(preset):
    published = model_values_from_hf(PUBLISHED[preset])
    for key, value in MODEL_PRESETS[preset].items():
        if key in published and key != "seq_length":  # pretraining length, not in config.json
            assert published[key] == value, key
    model = make_config({"model_preset": preset, "mock_data": True}).model
    family = PUBLISHED[preset]["model_type"]
    assert sum(torch.Size(shape).numel() for shape in hf_shapes(family, model).values()) == PARAMETERS[preset]


@pytest.mark.parametrize(("values", "message"), [
    ({"model_preset": "gpt2-124m", "use_rope_scaling": True},
     "--use-rope-scaling acts only with --position-embedding-type rope"),
    ({"model_preset": "llama-tiny", "use_rope_scaling": True, "rope_scaling_high_freq_factor": 1.0},
     "rope-scaling-high-freq-factor (1.0) must exceed rope-scaling-low-freq-factor (1.0)"),
    ({"model_preset": "llama-tiny", "rope_scaling_factor": 0.0}, "rope-scaling-factor (0.0) must be positive"),
    ({"model_preset": "llama-tiny", "kv_channels": 0}, "kv-channels (0) must be at least 1"),
])
def test_impossible_family_settings_are_one_line(values, message):
    with pytest.raises(ConfigError) as error:
        make_config({**values, "mock_data": True})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_kv_channels_frees_the_head_dimension_from_the_hidden_size():
    config = make_config({"model_preset": "llama-tiny", "hidden_size": 96, "num_attention_heads": 8,
                          "num_query_groups": 2, "kv_channels": 16, "mock_data": True}).model
    assert config.head_dim == 16
