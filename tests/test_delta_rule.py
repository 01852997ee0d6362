"""The chunked gated delta rule equals the rule applied token by token (the recurrence of Yang et al., written
here from the paper), forward and gradients, for lengths that are not a multiple of the chunk, with documents
packed into a sequence, an entering state, and bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.model.linear_attention.delta_rule import chunk_gated_delta_rule
from tests.tolerances import assert_close_relative


def recurrent_reference(q, k, v, g, beta, scale, resets=None, initial_state=None):
    """S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T, o_t = S_t^T (scale q_t), one token at
    a time in fp64; S is zeroed before a token that starts a document."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    batch, length, heads, key_dim = k.shape
    state = (torch.zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float64) if initial_state is None
             else initial_state.double())
    outputs = []
    for t in range(length):
        if resets is not None:
            state = state * (~resets[:, t]).double()[:, None, None, None]
        decayed = state * g[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = decayed + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, scale * q[:, t]))
    return torch.stack(outputs, dim=1), state


def _inputs(length: int, dtype: torch.dtype, seed: int = 0, batch: int = 2, heads: int = 3, key_dim: int = 8,
            value_dim: int = 6):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q = torch.nn.functional.normalize(randn(batch, length, heads, key_dim), dim=-1)
    k = torch.nn.functional.normalize(randn(batch, length, heads, key_dim), dim=-1)
    v = randn(batch, length, heads, value_dim)
    g = -0.05 * torch.nn.functional.softplus(randn(batch, length, heads))  # slow decays: the past still counts
    beta = torch.sigmoid(randn(batch, length, heads))
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("documents", [False, True], ids=["one_stream", "documents"])
def test_the_chunked_rule_equals_the_recurrence_forward_and_backward(dtype, documents):
    length, chunk = 45, 16  # three chunks, the last one partial
    inputs = _inputs(length, dtype)
    resets = None
    if documents:  # documents starting inside a chunk, at a chunk boundary (16) and two tokens in a row
        resets = torch.zeros(2, length, dtype=torch.bool)
        resets[0, [5, 16, 17, 40]] = True
        resets[1, [30]] = True
    scale = 8 ** -0.5
    initial = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(1)) * 0.1
    out, state = chunk_gated_delta_rule(*inputs, scale=scale, resets=resets, initial_state=initial, chunk_size=chunk)
    assert out.dtype == dtype and out.shape == (2, length, 3, 6)
    expected, expected_state = recurrent_reference(*[x.detach() for x in inputs], scale, resets, initial)
    # bf16 inputs are read exactly in fp32/fp64 by both; the output is rounded to bf16 once
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close_relative(out.double(), expected, rel=rel, msg="output")
    assert_close_relative(state.double(), expected_state, rel=1e-5, msg="final state")

    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((out.float() * weights).sum() + state.sum(), inputs)
    reference_inputs = [x.detach().double().requires_grad_() for x in inputs]
    ref_out, ref_state = recurrent_reference(*reference_inputs, scale, resets, initial)
    ref_grads = torch.autograd.grad((ref_out * weights.double()).sum() + ref_state.sum(), reference_inputs)
    for name, grad, ref in zip(["q", "k", "v", "g", "beta"], grads, ref_grads):
        assert_close_relative(grad.double(), ref, rel=1e-5 if dtype == torch.float32 else 2e-2, msg=name)


def test_a_document_start_forgets_everything_before_it():
    """The tokens after a start give the same outputs as that document alone, whatever came before."""
    q, k, v, g, beta = (x.detach() for x in _inputs(40, torch.float32, batch=1))
    resets = torch.zeros(1, 40, dtype=torch.bool)
    resets[0, 23] = True
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.5, resets=resets, chunk_size=16)
    alone, _ = chunk_gated_delta_rule(*(x[:, 23:] for x in (q, k, v, g, beta)), scale=0.5, chunk_size=16)
    assert_close_relative(packed[:, 23:], alone, rel=1e-5)
    assert packed[:, :23].abs().sum() > 0
