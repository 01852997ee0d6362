"""Mamba-2 (the M of --hybrid-layer-pattern): the chunked scan equals the recurrence it stands for, the mixer equals
transformers' Nemotron-H mixer, and the model's FLOPs and saved bytes are what torch counts and autograd keeps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config.arguments import make_config
from megatron_lite.model.mamba.mixer import Mamba2Mixer
from megatron_lite.model.mamba.ssd import ssd_chunked, ssd_recurrent
from megatron_lite.parallel.state import ParallelState
from tests.helpers import TINY_2_LAYERS, saved_bytes_per_token
from tests.tolerances import assert_close_relative

# 4 heads of 8 in 2 groups, state 16
MAMBA = {"mamba_head_dim": 8, "mamba_num_heads": 4, "mamba_num_groups": 2, "mamba_state_dim": 16}


def _scan_inputs(dtype: torch.dtype, b=2, s=37, heads=4, p=8, groups=2, n=16):
    generator = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    inputs = {"x": draw(b, s, heads, p).to(dtype), "dt": F.softplus(draw(b, s, heads)).to(dtype),
              "A": -torch.rand(heads, generator=generator) - 0.5, "B": draw(b, s, groups, n).to(dtype),
              "C": draw(b, s, groups, n).to(dtype), "D": draw(heads)}
    return {name: t.requires_grad_() for name, t in inputs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_documents", [False, True])
def test_the_chunked_scan_equals_the_recurrence_forward_and_backward(dtype, with_documents):
    """37 tokens in chunks of 16 (the last one short), documents starting at tokens 5 and 20 (first sequence) and 16
    (second, a chunk boundary), and a state entering the first token."""
    inputs = _scan_inputs(dtype)
    resets = torch.zeros(2, 37, dtype=torch.bool)
    if with_documents:
        resets[0, 5] = resets[0, 20] = resets[1, 16] = True
    entering = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    results = []
    for scan in (lambda **kw: ssd_chunked(**kw, chunk_size=16), ssd_recurrent):
        y, state = scan(**inputs, resets=resets if with_documents else None, initial_state=entering)
        weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        grads = torch.autograd.grad((y.float() * weights).sum() + state.sum(), [*inputs.values(), entering])
        results.append((y.float(), state, grads))
    (y, state, grads), (y_ref, state_ref, grads_ref) = results
    rel = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding, the same in both
    assert_close_relative(y, y_ref, rel=rel, msg="output")
    assert_close_relative(state, state_ref, rel=1e-5, msg="final state")
    for name, grad, grad_ref in zip([*inputs, "entering state"], grads, grads_ref, strict=True):
        assert_close_relative(grad.float(), grad_ref.float(), rel=max(rel, 1e-5), msg=name)


def test_a_document_start_hides_every_earlier_token():
    """The second document's outputs are those of the second document scanned alone."""
    inputs = {name: t.detach() for name, t in _scan_inputs(torch.float32).items()}
    resets = torch.zeros(2, 37, dtype=torch.bool)
    resets[:, 20] = True
    y, _ = ssd_chunked(**inputs, resets=resets, chunk_size=16)
    alone = {name: t[:, 20:] if t.dim() > 1 else t for name, t in inputs.items()}
    y_alone, _ = ssd_chunked(**alone, chunk_size=16)
    assert_close_relative(y[:, 20:], y_alone, rel=1e-5)


def _hf_mixer(seq_chunk: int):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    hf = NemotronHConfig(hidden_size=32, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
                         chunk_size=seq_chunk, hybrid_override_pattern="M", layer_norm_epsilon=1e-5)
    torch.manual_seed(3)
    mixer = NemotronHMamba2Mixer(hf, layer_idx=0)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape) * 0.3)
        mixer.A_log.copy_(torch.rand(4).log())
        mixer.dt_bias.copy_(torch.randn(4) - 1)
    return mixer


def _per_group(rows: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Hugging Face's parts [z, x, B, C, dt] (each for all groups, in group order) -> ours: every part of group 0,
    then of group 1, ..."""
    return torch.cat([part for g in range(groups) for part in (r.chunk(groups)[g] for r in rows)])


def test_the_mixer_equals_transformers_nemotron_h_mixer():
    """150 tokens (two chunks of 128, the second short); Hugging Face's weights laid out per group."""
    hf = _hf_mixer(128)
    config = make_config({**TINY_2_LAYERS, **MAMBA, "hidden_size": 32, "num_layers": None,
                          "hybrid_layer_pattern": "M-M-", "seq_length": 150, "max_position_embeddings": 150,
                          "norm_epsilon": 1e-5})
    ours = Mamba2Mixer(config.model, ParallelState.single(), sequence_parallel=False)
    inner, states = 32, 2 * 16  # the channels of z or x, and of B or C: every group's
    with torch.no_grad():
        z, x, B, C, dt = hf.in_proj.weight.split([inner, inner, states, states, 4])
        ours.in_proj.weight.copy_(_per_group([z, x, B, C, dt], 2))
        for hf_conv, our_conv in ((hf.conv1d.weight, ours.conv1d_weight), (hf.conv1d.bias, ours.conv1d_bias)):
            x, B, C = hf_conv.split([inner, states, states])
            our_conv.copy_(_per_group([x, B, C], 2))
        for name in ("A_log", "D", "dt_bias"):
            getattr(ours, name).copy_(getattr(hf, name))
        ours.norm_weight.copy_(hf.norm.weight)
        ours.out_proj.weight.copy_(hf.out_proj.weight)
    hidden = torch.randn(2, 150, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(hidden)
        actual = ours(hidden.transpose(0, 1)).transpose(0, 1)
    assert_close_relative(actual, expected, rel=1e-5)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("recompute", [None, "selective"])
def test_the_planned_mamba_bytes_per_token_are_what_autograd_saves(bf16, recompute):
    """Two sequence lengths cancel what does not grow with it; the mixer's input (the norm's output, counted with
    the layer) and the parameters are left out."""
    from megatron_lite.model.kinds.mamba import mamba_bytes

    config = make_config({**TINY_2_LAYERS, **MAMBA, "num_layers": None, "hybrid_layer_pattern": "M-", "bf16": bf16,
                          "recompute_granularity": recompute})
    dtype = torch.bfloat16 if bf16 else torch.float32
    layer = Mamba2Mixer(config.model, ParallelState.single(), sequence_parallel=False).to(dtype)
    assert saved_bytes_per_token(layer, config.model.hidden_size, dtype) == mamba_bytes(config)


@pytest.mark.parametrize("seq_length", [32, 150], ids=["one_partial_chunk", "two_chunks"])
def test_model_flops_are_the_matmuls_torch_counts_in_a_forward(seq_length):
    """The forward's matrix products as torch's FLOP counter sees them (the model FLOPs are three forwards) in a
    Nemotron-H-like stack, M- M *-: the chunked scan's products over the padded chunks, the projections, the MLPs
    and the head; the softmax layer's attention square (SDPA's kernel, which the counter does not see) added from
    its definition, 2 x 2 x s x heads x head_dim."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_lite.model.flops import training_flops_per_token
    from megatron_lite.model.gpt import GPTModel

    m = make_config({**TINY_2_LAYERS, **MAMBA, "num_layers": None, "hybrid_layer_pattern": "M-M*-",
                     "seq_length": seq_length, "max_position_embeddings": seq_length}).model
    model = GPTModel(m, ParallelState.single(), padded_vocab=m.vocab_size, seed=1)
    ids = torch.randint(0, m.vocab_size, (2, seq_length))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, torch.arange(seq_length), labels=ids)
    counted = counter.get_total_flops() / (2 * seq_length) + 4 * seq_length * m.num_attention_heads * m.head_dim
    assert training_flops_per_token(m) / 3 == pytest.approx(counted, rel=1e-12)


def test_cached_decoding_equals_the_full_forward():
    """The Mamba-2 layers' recurrent state (the scan's state and the convolution's last inputs) beside the
    attention layer's KV cache: a prompt, then 3 tokens at once, then one at a time."""
    from megatron_lite.model.gpt import GPTModel
    from tests.helpers import HF_VOCAB
    from tests.test_generation import assert_cached_decoding_equals_full_forward

    m = make_config({**TINY_2_LAYERS, **MAMBA, "num_layers": None, "hybrid_layer_pattern": "M-M*-",
                     "vocab_size": HF_VOCAB}).model
    model = GPTModel(m, ParallelState.single(), padded_vocab=m.vocab_size, seed=1).eval()
    assert_cached_decoding_equals_full_forward(model)


# The published config.json values (Hugging Face's names) of the presets' checkpoints
_NEMOTRON_COMMON = {"num_attention_heads": 32, "head_dim": 128, "mamba_head_dim": 64, "ssm_state_size": 128,
                    "n_groups": 8, "conv_kernel": 4, "vocab_size": 131072, "mlp_hidden_act": "relu2",
                    "tie_word_embeddings": False}
PUBLISHED = {
    "nemotron-h-8b": {**_NEMOTRON_COMMON, "hidden_size": 4096, "intermediate_size": 21504, "num_key_value_heads": 8,
                      "mamba_num_heads": 128,
                      "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"},
    "nemotron-3-nano-30b-a3b": {
        **_NEMOTRON_COMMON, "hidden_size": 2688, "intermediate_size": 1856, "num_key_value_heads": 2,
        "mamba_num_heads": 64, "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712, "routed_scaling_factor": 2.5,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"},
    "nemotron-3-super-120b-a12b": {
        **_NEMOTRON_COMMON, "hidden_size": 4096, "intermediate_size": 2688, "num_key_value_heads": 2,
        "mamba_num_heads": 128, "n_routed_experts": 512, "num_experts_per_tok": 22, "moe_intermediate_size": 2688,
        "moe_latent_size": 1024, "moe_shared_expert_intermediate_size": 5376, "routed_scaling_factor": 5.0,
        "hybrid_override_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*"
                                   "EMEMEMEM*EMEMEMEME",
        "num_nextn_predict_layers": 1, "mtp_hybrid_override_pattern": "*E"},
}


def _published_parameters(hf: dict) -> tuple[int, int]:
    """(parameters, of which routed experts') of a checkpoint of `hf` as NVIDIA stores it, from transformers'
    NemotronHForCausalLM modules: one RMSNorm per block; a Mamba-2 mixer's in_proj (z, x, B, C, dt), depthwise
    convolution with bias, dt_bias, A_log, D, gated norm and out_proj; attention's q, k, v, o; an MLP's up and down;
    an MoE block's router, experts (up and down each, in the latent where moe_latent_size gives one, with the
    projections to it and back) and shared expert; the embedding, final norm and untied head; and each of the
    num_nextn_predict_layers prediction depths: the blocks of mtp_hybrid_override_pattern, enorm, hnorm, the 2h -> h
    eh_proj and a final norm (transformers builds no such depth; Megatron-Bridge converts them)."""
    h, heads, groups = hf["hidden_size"], hf["mamba_num_heads"], hf["n_groups"]
    inner, states = heads * hf["mamba_head_dim"], groups * hf["ssm_state_size"]
    q, kv = hf["num_attention_heads"] * hf["head_dim"], hf["num_key_value_heads"] * hf["head_dim"]
    routed, latent, shared = (hf.get(key, 0) for key in ("n_routed_experts", "moe_latent_size",
                                                         "moe_shared_expert_intermediate_size"))
    experts = routed * 2 * (latent or h) * hf.get("moe_intermediate_size", 0)
    mixers = {"M": h * (2 * inner + 2 * states + heads) + (inner + 2 * states) * (hf["conv_kernel"] + 1)
              + 3 * heads + inner + inner * h,
              "*": h * q + 2 * h * kv + q * h, "-": 2 * h * hf["intermediate_size"],
              "E": routed * h + experts + 2 * h * latent + 2 * h * shared}
    depths = hf.get("num_nextn_predict_layers", 0)
    blocks = hf["hybrid_override_pattern"] + hf.get("mtp_hybrid_override_pattern", "") * depths
    total = sum(h + mixers[symbol] for symbol in blocks) + 2 * hf["vocab_size"] * h + h
    return total + depths * (2 * h + 2 * h * h + h), experts * blocks.count("E")


def _transformers_count(m) -> int:
    """transformers' NemotronHForCausalLM of the config.json our model exports, built on the meta device: its
    parameters (no prediction depth: it builds none) and not the expert biases, which it holds as buffers (ours are
    buffers too, not counted)."""
    import transformers

    from megatron_lite.hf.families import hf_config_from_model

    config = transformers.NemotronHConfig(**{k: v for k, v in hf_config_from_model(m, torch.bfloat16).items()
                                             if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        model = transformers.NemotronHForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def _activated(hf: dict, total: int, routed: int) -> float:
    """What one token uses: all but the routed experts it is not sent to and the input embedding."""
    unused = routed * (1 - hf["num_experts_per_tok"] / hf["n_routed_experts"])
    return total - unused - hf["vocab_size"] * hf["hidden_size"]


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_shapes_and_parameter_counts(preset):
    """Nemotron-H 8B: 8,100,852,736 parameters; Nemotron 3 Nano: 31.6B, 3.2B activated without the input embedding
    (NVIDIA's figures); Nemotron 3 Super: 120B, 12B activated (NVIDIA's), and its files' 123,611,033,088 elements
    (Megatron-Bridge's count of the BF16 checkpoint, MTP depth and the routers' expert biases included)."""
    from megatron_lite.config.layer_split import model_chunk_plans
    from megatron_lite.planning.state_memory import chunk_params

    hf = PUBLISHED[preset]
    config = make_config({"model_preset": preset, "mock_data": True})
    m = config.model
    depths = hf.get("num_nextn_predict_layers", 0)
    assert (m.hybrid_layer_pattern, m.hidden_size, m.ffn_hidden_size, m.num_query_groups, m.kv_channels,
            m.mamba_num_heads, m.mamba_head_dim, m.mamba_state_dim, m.mamba_num_groups, m.vocab_size,
            m.mtp_num_layers) == (
        hf["hybrid_override_pattern"] + f"/{hf.get('mtp_hybrid_override_pattern')}" * depths, hf["hidden_size"],
        hf["intermediate_size"], hf["num_key_value_heads"], hf["head_dim"], hf["mamba_num_heads"],
        hf["mamba_head_dim"], hf["ssm_state_size"], hf["n_groups"], hf["vocab_size"], depths or None)
    assert m.squared_relu and not m.swiglu and m.position_embedding_type == "none"
    shapes = chunk_params(config, model_chunk_plans(config, 0)[0])
    total, routed = sum(s.numel for s in shapes), sum(s.numel for s in shapes if s.expert)
    assert (total, routed) == _published_parameters(hf)
    decoder, decoder_routed = _published_parameters({**hf, "num_nextn_predict_layers": 0})
    assert decoder == _transformers_count(config.model)  # which builds no prediction depth
    if preset == "nemotron-h-8b":
        assert total == 8_100_852_736
        return
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size,
            m.moe_latent_size, m.moe_router_topk_scaling_factor) == (
        hf["n_routed_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"],
        hf["moe_shared_expert_intermediate_size"], hf.get("moe_latent_size"), hf["routed_scaling_factor"])
    activated = _activated(hf, decoder, decoder_routed)
    if preset == "nemotron-3-nano-30b-a3b":
        assert round(total / 1e9, 1) == 31.6 and round(activated / 1e9, 1) == 3.2
    else:
        assert int(decoder / 1e9) == 120 and int(activated / 1e9) == 12
        moe_blocks = (hf["hybrid_override_pattern"] + hf["mtp_hybrid_override_pattern"]).count("E")
        assert total + moe_blocks * hf["n_routed_experts"] == 123_611_033_088


@pytest.mark.parametrize("values,message", [
    ({"mamba_num_heads": 6}, r"mamba-num-heads \(6\) must be a multiple of mamba-num-groups \(4\)"),
    ({"tensor_model_parallel_size": 8}, r"tensor-model-parallel-size \(8\) must divide mamba-num-groups \(4\)"),
    ({"tensor_model_parallel_size": 2, "context_parallel_size": 4},
     r"context-parallel-size \(4\) must divide the Mamba-2 groups of each tensor-parallel rank"),
    ({"mamba_num_heads": None, "mamba_head_dim": 48}, r"2 x hidden-size \(128\) must be divisible by "
                                                      r"mamba-head-dim \(48\)"),
    ({"fp8_format": "e4m3"}, r"--fp8-format does not apply to Mamba-2 layers \(M\) yet"),
    ({"hybrid_layer_pattern": None, "num_layers": 2}, r"--mamba-num-groups acts only with --hybrid-layer-pattern"),
    ({"hybrid_layer_pattern": "*-*-"}, r"--mamba-num-groups acts only with --hybrid-layer-pattern writing M layers"),
])
def test_mamba_sizes_that_cannot_be_built_are_one_line_before_a_model_exists(values, message):
    base = {**TINY_2_LAYERS, "num_layers": None, "hybrid_layer_pattern": "M-M*-", "hidden_size": 64,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_num_groups": 4, "mamba_state_dim": 16,
            "seq_length": 64, "max_position_embeddings": 64}
    from megatron_lite.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_config({**base, **values}, 8)


def test_a_checkpoint_of_another_state_size_is_one_line_naming_it(tmp_path):
    from megatron_lite.errors import CheckpointError
    from tests.helpers import train_losses

    values = {**TINY_2_LAYERS, **MAMBA, "num_layers": None, "hybrid_layer_pattern": "M-*-", "train_iters": 2}
    train_losses({**values, "save": str(tmp_path / "ckpt")}, 1)
    with pytest.raises(CheckpointError, match=r"it was saved with .*mamba_state_dim"):
        train_losses({**values, "mamba_state_dim": 32, "load": str(tmp_path / "ckpt")}, 1)
