"""Sliding-window attention (--window-size, --window-attn-skip-freq) and attention sinks (--softmax-type), as
gpt-oss has them: the attention equals its definition computed query by query (forward and gradients, with
packed documents and grouped heads); a model with both trains as one process at TP2 (sinks split with their
heads), PP2 and CP2 of each --cp-comm-type, with documents; cached decoding equals the full forward; the window
pattern is Megatron's; the planner's saved bytes of the attention (windowed, with sinks, with an output gate) are
what autograd saves; bad values are one line each."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_pattern import window_attention_pattern
from megatron_lite.errors import ConfigError
from megatron_lite.model.attention.window_and_sinks import window_sink_attention
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, assert_run_matches, join_shards, train_and_collect
from tests.tolerances import assert_close_relative


def reference_attention(q, k, v, window, sinks, ids):
    """For each query (b, head, i): softmax over the keys j <= i with i - j <= window in its document, and the
    sink logit, the sink's share dropped; fp64, one query at a time."""
    s, b, heads, d = q.shape
    groups = heads // k.shape[2]
    out = torch.zeros(s, b, heads, d, dtype=torch.float64)
    for batch in range(b):
        for head in range(heads):
            for i in range(s):
                keys = [j for j in range(i + 1) if (window is None or i - j <= window)
                        and (ids is None or ids[batch, j] == ids[batch, i])]
                logits = torch.stack([q[i, batch, head].double() @ k[j, batch, head // groups].double() / math.sqrt(d)
                                      for j in keys])
                if sinks is not None:
                    logits = torch.cat([logits, sinks[head].double().reshape(1)])
                weights = logits.softmax(0)[:len(keys)]
                out[i, batch, head] = sum(w * v[j, batch, head // groups].double() for w, j in zip(weights, keys))
    return out.reshape(s, b, -1)


@pytest.mark.parametrize("window,with_sinks,documents", [(3, True, False), (None, True, True), (4, False, True)],
                         ids=["window_sinks", "sinks_documents", "window_documents"])
def test_the_attention_equals_its_definition_forward_and_backward(window, with_sinks, documents):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(10, 2, 4, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(10, 2, 2, 8, generator=generator, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=generator, requires_grad=True) if with_sinks else None
    ids = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3]) if documents else None
    out = window_sink_attention(q, k, v, window=window, sinks=sinks, document_ids=ids)
    expected = reference_attention(q, k, v, window, sinks, ids)
    assert_close_relative(out.double(), expected.detach(), rel=1e-5)
    weights = torch.randn(out.shape, generator=generator)
    inputs = [t for t in (q, k, v, sinks) if t is not None]
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    reference_grads = torch.autograd.grad((expected * weights.double()).sum(), inputs)
    for grad, ref in zip(grads, reference_grads):
        assert_close_relative(grad.double(), ref.double(), rel=1e-5)


GPT_OSS_LIKE = {**TINY_2_LAYERS, "num_layers": 4, "window_size": [5, 0], "window_attn_skip_freq": 2,
                "softmax_type": "learnable", "disable_bias_linear": False, "train_iters": 4,
                "reset_attention_mask": True, "attention_dropout": 0.0, "hidden_dropout": 0.0}


def test_window_attn_skip_freq_is_megatrons_pattern():
    def pattern(freq):
        return window_attention_pattern(make_config({**GPT_OSS_LIKE, "window_attn_skip_freq": freq}).model)

    assert pattern(2) == [True, False, True, False]  # gpt-oss: windowed, then full, alternating
    assert pattern("[1,1,0,1]") == [True, True, False, True]
    assert pattern(None) == [True] * 4


LAYOUTS = {  # on 2 ranks; under CP the 5-key windows and the documents cross the ranks' 8-token chunks
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    **{f"cp2_{kind}": {"context_parallel_size": 2, "cp_comm_type": kind} for kind in ("p2p", "allgather", "a2a")},
    "cp2_a2a+p2p": {"context_parallel_size": 2, "cp_comm_type": "a2a+p2p",
                    "hierarchical_context_parallel_sizes": [2, 1]},
}


def _train_layouts() -> dict:
    return {name: train_and_collect({**GPT_OSS_LIKE, **flags}, 2) for name, flags in LAYOUTS.items()}


def test_windows_and_sinks_train_as_one_process_at_tp2_pp2_and_cp2_of_each_type():
    """The learned sinks move (their gradients are compared too) and are split over TP with the heads (and over CP
    by a2a)."""
    expected = train_and_collect(GPT_OSS_LIKE, 1)
    per_rank = run_on_ranks(2, _train_layouts)
    for name in LAYOUTS:
        assert_run_matches([runs[name] for runs in per_rank], expected, rel=1e-5, tensor_rel=1e-4)
    sink_grads = [tensor for (name, _), tensor in join_shards([expected[2]]).items() if name.endswith("sinks")]
    assert len(sink_grads) == 4 and all(grad.abs().max() > 0 for grad in sink_grads)


def test_cached_decoding_with_windows_and_sinks_equals_the_full_forward():
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.state import ParallelState
    from tests.test_generation import assert_cached_decoding_equals_full_forward

    m = make_config({**GPT_OSS_LIKE, "vocab_size": 300, "window_size": [3, 0], "softmax_type": "off-by-one",
                     "reset_attention_mask": False}).model
    torch.manual_seed(0)
    model = GPTModel(m, ParallelState.single(), padded_vocab=300, seed=1).eval()
    assert_cached_decoding_equals_full_forward(model)


@pytest.mark.parametrize("values,message", [
    ({"window_size": [5, 2]}, r"window-size \[5, 2\] must be LEFT 0"),
    ({"window_size": None, "window_attn_skip_freq": None, "attention_dropout": 0.1},
     "--softmax-type learnable needs --attention-dropout 0"),
    ({"window_attn_skip_freq": "[1,0]"}, r"--window-attn-skip-freq '\[1,0\]': the pattern has 2 entries for 4"),
])
def test_impossible_window_and_sink_settings_are_one_line(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config({**GPT_OSS_LIKE, **values}, 2)


def test_gpt_oss_clamped_swiglu_equals_transformers_expert_activation():
    """--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7 on fc1's [gate; up] halves is
    transformers' GptOssExperts gate (which reads the halves interleaved: gate = [..., ::2], up = [..., 1::2])."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from megatron_lite.model.mlp import activation

    theirs = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=16, num_local_experts=2))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)) * 6  # beyond the clamp of 7
    ours = activation(make_config({**GPT_OSS_LIKE, "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
                                   "activation_func_clamp_value": 7.0}).model, x)
    interleaved = torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(-2)  # [g0, u0, g1, u1, ...]
    assert_close_relative(ours, theirs._apply_gate(interleaved), rel=1e-6)
    assert (x.abs() > 7).any()


def test_a_clamped_quick_geglu_model_trains_as_one_process_at_tp2():
    """The activation is elementwise on each rank's fc1 halves: TP2 + SP equals one process."""
    values = {**GPT_OSS_LIKE, "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
              "activation_func_clamp_value": 0.05, "train_iters": 2}  # a clamp that bites at these small weights
    assert_run_matches(run_on_ranks(2, train_and_collect, {**values, "tensor_model_parallel_size": 2,
                                                           "sequence_parallel": True}, 2),
                       train_and_collect(values, 1), rel=1e-5, tensor_rel=1e-4)


def test_the_gated_unit_options_need_a_gated_unit_and_quick_geglu_excludes_swiglu():
    with pytest.raises(ConfigError, match="--activation-func-clamp-value acts only with --swiglu or --quick-geglu"):
        make_config({**TINY_2_LAYERS, "swiglu": False, "activation_func_clamp_value": 7.0})
    with pytest.raises(ConfigError, match="--quick-geglu and --swiglu exclude each other"):
        make_config({**TINY_2_LAYERS, "quick_geglu": True})


ATTENTIONS = {"fused": {}, "window": {"window_size": [5, 0]}, "sinks": {"softmax_type": "learnable"},
              "window_and_sinks": {"window_size": [5, 0], "softmax_type": "learnable"},
              "output_gate": {"attention_output_gate": True},
              "output_gate_and_sinks": {"attention_output_gate": True, "softmax_type": "learnable"}}


MATERIALISED = ("window", "sinks", "window_and_sinks", "output_gate_and_sinks")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("attention,batch,documents", [
    *[(attention, batch, False) for attention in ATTENTIONS for batch in (1, 2)],
    *[(attention, 2, True) for attention in MATERIALISED]])  # the fused kernel's document path is another's test
def test_the_planned_softmax_attention_bytes_are_what_autograd_saves(attention, batch, documents, bf16):
    """One layer's attention at s 32 (the materialised scores grow with s^2, so one length is compared whole): the
    planner's bytes plus the RoPE cos and sin tables, which the planner counts once per model chunk; the layer's
    input and the parameters are left out."""
    from megatron_lite.model.attention.self_attention import Documents, SelfAttention, rotary_embedding
    from megatron_lite.model.kinds.softmax_attention import softmax_attention_bytes
    from megatron_lite.parallel.state import ParallelState
    from tests.helpers import saved_bytes

    values = {**TINY_2_LAYERS, "attention_dropout": 0.0, "micro_batch_size": batch, "bf16": bf16,
              "reset_attention_mask": documents, **ATTENTIONS[attention]}
    config = make_config(values)
    m, dtype = config.model, torch.bfloat16 if bf16 else torch.float32
    window = m.window_size[0] if m.window_size else None
    layer = SelfAttention(m, ParallelState.single(), sequence_parallel=False, backend="sdpa", rng_tracker=None,
                          window=window).to(dtype)
    s = m.seq_length
    positions = rotary_embedding(m)(torch.arange(s))
    if documents:
        ids = torch.tensor([[0] * 12 + [1] * (s - 12)] * batch)
        positions = positions._replace(documents=Documents(ids, torch.device("cpu")))
    x = torch.randn(s, batch, m.hidden_size, dtype=dtype, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in (x, *layer.parameters())}
    tables = 2 * 4 * s * m.head_dim
    planned = softmax_attention_bytes(config, attention in MATERIALISED)
    assert saved_bytes(layer, x, positions, skip) == planned + tables


@pytest.mark.parametrize("attention,documents", [*[(attention, False) for attention in ATTENTIONS],
                                                 *[(attention, True) for attention in MATERIALISED]])
def test_selective_recompute_keeps_only_the_core_attentions_inputs_for_every_softmax_attention(attention, documents):
    """--recompute-granularity selective acts on every kind of softmax attention: with windows and sinks too the
    saved bytes fall (the materialised scores are recomputed, not kept) to the planner's, the fused kernel's
    inputs and output; and the recomputed layer's gradients equal the plain layer's."""
    from megatron_lite.model.attention.self_attention import Documents, SelfAttention, rotary_embedding
    from megatron_lite.model.kinds.softmax_attention import softmax_attention_bytes
    from megatron_lite.parallel.state import ParallelState
    from tests.helpers import saved_bytes

    measured, planned, gradients = {}, {}, {}
    for recompute in (None, "selective"):
        values = {**TINY_2_LAYERS, "attention_dropout": 0.0, "micro_batch_size": 2, "reset_attention_mask": documents,
                  "recompute_granularity": recompute, **ATTENTIONS[attention]}
        config = make_config(values)
        m = config.model
        layer = SelfAttention(m, ParallelState.single(), sequence_parallel=False, backend="sdpa", rng_tracker=None,
                              window=m.window_size[0] if m.window_size else None).train()
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # the layer alone: its weights are not initialised by a model
            for parameter in layer.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        s = m.seq_length
        positions = rotary_embedding(m)(torch.arange(s))
        if documents:
            ids = torch.tensor([[0] * 12 + [1] * (s - 12)] * 2)
            positions = positions._replace(documents=Documents(ids, torch.device("cpu")))
        x = torch.randn(s, 2, m.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
        skip = {t.untyped_storage().data_ptr() for t in (x, *layer.parameters())}
        measured[recompute] = saved_bytes(layer, x, positions, skip) - 2 * 4 * s * m.head_dim  # less RoPE tables
        planned[recompute] = softmax_attention_bytes(config, attention in MATERIALISED)
        layer(x, positions).square().sum().backward()
        gradients[recompute] = [x.grad, *(p.grad for p in layer.parameters())]
    assert measured == planned
    assert measured["selective"] < measured[None]
    for plain, recomputed in zip(gradients[None], gradients["selective"]):
        assert_close_relative(recomputed, plain, rel=1e-6)
