"""Multi-latent attention and its YaRN RoPE: YaRN's frequencies and scales equal transformers' rope_type "yarn"
and DeepSeek-V3 softmax scale; with and without a query latent, one forward and backward at TP2 and TP2 + SP
equals one process (logits and the gradient of every parameter, so the replicated down-projections' and latent
norms' gradients are summed over TP), and so does training under TP2 + SP (selective recomputation), PP2 (full
recomputation), CP2 (p2p, all-gather and a2a, V padded) and CP4 as a2a+p2p (2 x 2); the planner's activation
bytes per token are what autograd saves (its parameter bytes: test_deepseek_v3.py); model FLOPs are the matmuls
torch counts; and misconfigurations are one line. (Logits against transformers' DeepseekV3ForCausalLM are in
test_deepseek_v3.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config.arguments import make_config
from megatron_lite.errors import ConfigError
from megatron_lite.model.attention.self_attention import rotary_embedding
from megatron_lite.model.attention.yarn import YarnScaling
from megatron_lite.model.flops import training_flops_per_token
from megatron_lite.model.gpt import GPTModel
from megatron_lite.model.kinds.latent_attention import latent_attention_bytes
from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import run_on_ranks
from tests.helpers import SMALL, TINY_2_LAYERS, forward_backward, reference, saved_bytes, train_and_collect
from tests.helpers import assert_run_matches as assert_training_matches
from tests.tolerances import assert_close_relative

YARN = {"rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 8, "mscale": 1.0,
        "mscale_all_dim": 0.5}
# Four heads of 16 + 8 query-key and 16 value dimensions; YaRN stretching an 8-token context over 32 tokens.
MLA = {**SMALL, "model_preset": "llama-tiny", "group_query_attention": False, "num_query_groups": None,
       "num_attention_heads": 4, "ffn_hidden_size": 96, "multi_latent_attention": True, "qk_layernorm": True,
       "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 12, **YARN}
NO_Q_LATENT = {**MLA, "q_lora_rank": None}
TRAIN = {**TINY_2_LAYERS, **{k: v for k, v in MLA.items() if k not in SMALL}, "num_query_groups": None,
         "group_query_attention": False, "train_iters": 6}
TRAIN_LAYOUTS = {  # on 2 ranks
    "tp2_sp_selective_recompute": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                   "recompute_granularity": "selective"},
    "pp2_full_recompute": {"pipeline_model_parallel_size": 2, "recompute_granularity": "full"},
    "cp2_p2p": {"context_parallel_size": 2, "cp_comm_type": "p2p"},
    "cp2_allgather": {"context_parallel_size": 2, "cp_comm_type": "allgather"},
    "cp2_a2a": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
}


def test_yarn_frequencies_and_scales_equal_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    for mscale, all_dim in ((1.0, 1.0), (1.0, 0.5), (0.707, 0.707)):
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": all_dim}
        hf = DeepseekV3Config(qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840,
                              rope_parameters=rope)
        theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        config = make_config({**MLA, "qk_pos_emb_head_dim": 64, "qk_head_dim": 128, "rotary_scaling_factor": 40.0,
                              "yarn_original_max_position_embeddings": 4096, "mscale": mscale,
                              "mscale_all_dim": all_dim}).model
        rotary = rotary_embedding(config)
        torch.testing.assert_close(rotary.inv_freq, theirs, rtol=1e-6, atol=0)
        assert rotary.attention_factor == pytest.approx(attention_factor, rel=1e-12)
        assert YarnScaling.of(config).softmax_scale(192) == pytest.approx(yarn_apply_mscale(rope, 192 ** -0.5),
                                                                           rel=1e-12)
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2) / 64)
    assert (theirs == plain).any() and (theirs == plain / 40).any(), "the ramp must keep some and stretch others"


def test_yarn_with_factor_one_is_plain_rope():
    config = make_config({**MLA, "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0}).model
    rotary = rotary_embedding(config)
    torch.testing.assert_close(rotary.inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 8, 2) / 8), rtol=1e-6, atol=0)
    assert rotary.attention_factor == 1.0
    assert YarnScaling.of(config).softmax_scale(24) == 1 / math.sqrt(24)


def _tp2_cases() -> dict:
    pstate = ParallelState.build(Layout.from_world(2, tp=2))
    return {(name, sp): forward_backward({**values, "tensor_model_parallel_size": 2, "sequence_parallel": sp},
                                         pstate, 2)
            for name, values in (("q_latent", MLA), ("no_q_latent", NO_Q_LATENT)) for sp in (False, True)}


def test_tp2_and_sequence_parallel_match_one_process_with_and_without_a_query_latent():
    references = {"q_latent": forward_backward(MLA, ParallelState.single(), 1),
                  "no_q_latent": forward_backward(NO_Q_LATENT, ParallelState.single(), 1)}
    replicated = {"linear_q_down_proj.weight", "q_layernorm.weight", "linear_kv_down_proj.weight",
                  "kv_layernorm.weight"}
    names = {name.split("self_attention.")[1] for name in references["q_latent"]["grads"] if "self_attention" in name}
    assert replicated | {"linear_q_up_proj.weight", "linear_kv_up_proj.weight", "linear_proj.weight"} == names
    for (name, sp), got in run_on_ranks(2, _tp2_cases)[0].items():
        expected = references[name]
        assert_close_relative(got["logits"], expected["logits"], rel=1e-5, msg=f"{name} sp={sp}")
        for param, grad in expected["grads"].items():
            assert grad.abs().max() > 0, param
            assert_close_relative(got["grads"][param], grad, rel=1e-5, msg=f"{name} sp={sp} {param}")


def _train_layouts() -> dict:
    return {name: train_and_collect({**TRAIN, **flags}, 2) for name, flags in TRAIN_LAYOUTS.items()}


def test_mla_trains_as_one_process_under_tp_sp_pp_cp_and_recomputation():
    expected = reference(TRAIN)
    per_rank = run_on_ranks(2, _train_layouts)
    for name in TRAIN_LAYOUTS:
        assert_training_matches([results[name] for results in per_rank], expected, rel=1e-5, tensor_rel=1e-4)


def _train_hierarchical_cp4() -> tuple:
    return train_and_collect({**TRAIN, "context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                              "hierarchical_context_parallel_sizes": [2, 2]}, 4)


def test_mla_trains_as_one_process_under_hierarchical_cp4_a2a_p2p():
    """Heads exchanged by all-to-all within pairs of CP ranks, K/V (V padded to the query-key head size) around a
    ring of the two pairs: losses, weights and gradients equal one process."""
    assert_training_matches(run_on_ranks(4, _train_hierarchical_cp4), reference(TRAIN), rel=1e-5, tensor_rel=1e-4)


def test_flops_per_token_are_the_matmuls_torch_counts():
    for values in (MLA, NO_Q_LATENT):
        m = make_config(values).model
        model = GPTModel(m, ParallelState.single(), padded_vocab=m.vocab_size, seed=1)
        ids = torch.randint(0, m.vocab_size, (2, m.seq_length))
        with FlopCounterMode(display=False) as counter:
            model(ids, torch.arange(m.seq_length), labels=ids).float().sum().backward()
        counted = counter.get_total_flops() / (2 * m.seq_length)
        ops = {str(op) for op in counter.get_flop_counts()["Global"]}
        if not any("attention" in op or "bmm" in op for op in ops):  # SDPA's kernel uncounted
            # the full square of QK^T over 4 heads of 24 dimensions and of PV over 12, forward + 2x backward
            counted += 3 * m.num_layers * 2 * m.seq_length * 4 * (24 + 12)
        assert training_flops_per_token(m) == pytest.approx(counted, rel=1e-12)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("values", [MLA, NO_Q_LATENT], ids=["q_latent", "no_q_latent"])
def test_planned_activation_bytes_per_token_are_what_autograd_saves(values, bf16):
    """With the core attention recomputed (selective) it saves only its inputs, so what the kernel itself keeps
    (the CPU's math path: the probabilities) is left out; two sequence lengths cancel what does not grow with it
    (the norms' fp32 weight copies)."""
    config = make_config({**values, "bf16": bf16, "recompute_granularity": "selective"})
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = GPTModel(config.model, ParallelState.single(), padded_vocab=config.model.vocab_size, seed=1).to(dtype)
    attention = model.train().decoder.layers[0].self_attention
    measured = []
    for seq in (16, 32):
        x = torch.randn(seq, 2, config.model.hidden_size, dtype=dtype, requires_grad=True)
        positions = model.rotary(torch.arange(seq))
        skip = {t.untyped_storage().data_ptr() for t in (x, positions.cos, positions.sin, *model.parameters())}
        measured.append(saved_bytes(attention, x, positions, skip))
    assert (measured[1] - measured[0]) / (16 * 2) == latent_attention_bytes(config)


@pytest.mark.parametrize(("values", "message"), [
    ({"group_query_attention": True, "num_query_groups": 2}, "--multi-latent-attention and --group-query-attention "
                                                             "exclude each other"),
    ({"position_embedding_type": "learned_absolute"}, "--multi-latent-attention needs --position-embedding-type rope"),
    ({"qk_pos_emb_head_dim": 7}, "RoPE needs an even qk-pos-emb-head-dim, got 7"),
    ({"kv_lora_rank": 0}, "kv-lora-rank (0) must be at least 1"),
    ({"disable_bias_linear": False}, "multi-latent attention has no biases"),
    ({"multi_latent_attention": False}, "--mscale-all-dim acts only with "
                                        "--multi-latent-attention"),
    ({"yarn_beta_fast": 1.0}, "yarn-beta-fast (1.0) must exceed yarn-beta-slow (1.0)"),
])
def test_impossible_latent_attention_settings_are_one_line(values, message):
    with pytest.raises(ConfigError) as error:
        make_config({**MLA, **values})
    assert message in str(error.value) and "\n" not in str(error.value)
