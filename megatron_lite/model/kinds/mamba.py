"""The Mamba-2 mixer (model/mamba/mixer.py) of Nemotron-H and Nemotron 3, the `M` of --hybrid-layer-pattern.

Saved per token beyond its input projection's input, with the rank's heads H (of head dim p, so c = H p channels)
and groups G (state n), e the bytes of an activation: the convolution's input ([x, B, C], c + 2 G n channels), its
kernel - 1 shifted copies and its output (SiLU's input), 5 e (c + 2 G n); SiLU's output, which the scan keeps as its
x, B and C, e (c + 2 G n), and x's copy in heads, e c; softplus's input and output, 2 x 4 H; the scan keeps only its
inputs (it recomputes its chunks in backward); the gated norm's fp32 scan output, SiLU(z), their product and the
normalised output, 4 x 4 c, and the rsqrt per group, 4 G; the output projection's input e c; and z, which SiLU
saves: in fp32 a view that keeps the whole projection output, e (2 c + 2 G n + H), else its fp32 copy, 4 c.
Recomputed (selective), the core keeps only its input (the projection's output) and the output projection's input.
tests/test_mamba2.py checks it against autograd.
"""

from __future__ import annotations

import math

from megatron_lite.config.layer_specs import LayerSpec
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.model.kinds.activation_terms import FP32, micro_batch_tokens, param_bytes
from megatron_lite.model.kinds.kind import Kind
from megatron_lite.model.mamba.mixer import Mamba2Mixer, mamba_num_heads
from megatron_lite.model.mamba.ssd import CHUNK_SIZE


def build(config, pstate, number, spec, parts):
    return Mamba2Mixer(config, pstate, sequence_parallel=parts.sequence_parallel)


def flops(config: ModelConfig, spec: LayerSpec) -> float:
    """Twice the weights of its input and output projections, and the matrix products of the chunked scan (ssd.py)
    for each head, over the sequence padded to whole chunks of L (128, or the sequence when shorter): per token
    within its chunk C B^T (2 L n) and the scores times the inputs (2 L p), the chunk's state written (2 p n) and
    the entering state read (2 p n)."""
    h, heads, groups = config.hidden_size, mamba_num_heads(config), config.mamba_num_groups
    p, n = config.mamba_head_dim, config.mamba_state_dim
    weights = h * (2 * heads * p + 2 * groups * n + heads) + heads * p * h
    L = min(CHUNK_SIZE, config.seq_length)
    padded = math.ceil(config.seq_length / L) * L / config.seq_length
    return 2 * weights + heads * (2 * L * n + 2 * L * p + 4 * p * n) * padded


def mamba_bytes(config: Config) -> int:
    """Bytes per token a Mamba-2 mixer saves beyond its input projection's input (module docstring)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    e = param_bytes(config)
    heads, groups = mamba_num_heads(m) // tp, m.mamba_num_groups // tp
    channels, states = heads * m.mamba_head_dim, groups * m.mamba_state_dim
    projection = 2 * channels + 2 * states + heads
    if m.recompute_granularity == "selective":
        return e * projection + e * channels
    convolution = 5 * e * (channels + 2 * states) + e * (channels + 2 * states) + e * channels
    gated_norm = 4 * FP32 * channels + FP32 * groups + e * channels
    z = e * projection if e == FP32 else FP32 * channels
    return convolution + 2 * FP32 * heads + gated_norm + z


def saved_bytes(config: Config, spec: LayerSpec) -> int:
    return micro_batch_tokens(config)[0] * mamba_bytes(config)


KIND = Kind(build, flops, saved_bytes)
