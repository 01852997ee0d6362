"""Gated DeltaNet (model/linear_attention/gated_delta_net.py), Qwen3-Next's linear attention.

Saved per token instead of the attention's, with its rank's key and value heads (c = 2 dk nk + dv nv convolution
channels, e the bytes of an activation): its input projection's input e h; the convolution's input, its kernel - 1
shifted copies and its output, 5 e c; what the L2 norms of q and k read (in fp32 the convolution's SiLU output,
4 c; else its fp32 copies of q and k) and their 4-byte rsqrt per head; beta, the decay and softplus's input and
output, 4 x 4 bytes per value head; the delta rule's inputs, which are all it keeps (it recomputes its chunks in
backward): q and k repeated to the value heads in fp32, and v, e dv nv; the output side's fp32 rule output, its
contiguous copy, the normalized output, z and SiLU(z) (5 x 4 dv nv), the norm's rsqrt, and the output
projection's input e dv nv (tests/test_hybrid_models.py checks it against autograd). The ZB-H1 weight-pass bytes
count such a layer as softmax attention.
"""

from __future__ import annotations

import math

from megatron_lite.config.layer_specs import LayerSpec
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.model.kinds.activation_terms import FP32, micro_batch_tokens, param_bytes
from megatron_lite.model.kinds.kind import Kind
from megatron_lite.model.linear_attention.delta_rule import CHUNK_SIZE
from megatron_lite.model.linear_attention.gated_delta_net import GatedDeltaNet


def build(config, pstate, number, spec, parts):
    return GatedDeltaNet(config, pstate, sequence_parallel=parts.sequence_parallel)


def flops(config: ModelConfig, spec: LayerSpec) -> float:
    """Twice the weights of its input and output projections, and the matrix products of the chunked delta rule
    (delta_rule.py) for each value head, over the sequence padded to whole chunks of C (64, or the sequence when
    shorter): per token within its chunk q k^T and k k^T (2 C dk each), the scores times the corrections (2 C dv),
    and three products with the [dk, dv] state (read by the corrections and the queries, written once: 6 dk dv).
    The two triangular solves are not counted (nor by torch's FLOP counter)."""
    h, C = config.hidden_size, min(CHUNK_SIZE, config.seq_length)
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    weights = h * (2 * keys + 2 * values + 2 * config.linear_num_value_heads) + values * h
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    padded = math.ceil(config.seq_length / C) * C / config.seq_length
    mixing = config.linear_num_value_heads * (4 * C * dk + 2 * C * dv + 6 * dk * dv) * padded
    return 2 * weights + mixing


def gated_delta_net_bytes(config: Config) -> int:
    """Bytes per token a Gated DeltaNet layer saves beyond its input projection's input (module docstring), with
    its tensor-parallel rank's heads (context parallelism trades tokens for heads: the product is the same);
    recomputed (selective), its core keeps only its input and output."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    e = param_bytes(config)
    key_heads, value_heads = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
    dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
    if m.recompute_granularity == "selective":  # the core's input (the projections' output) and its gated output
        return e * (2 * key_heads * dk + 2 * value_heads * dv + 2 * value_heads) + e * value_heads * dv
    channels = key_heads * 2 * dk + value_heads * dv
    convolution = 5 * e * channels  # its input and the kernel - 1 shifted copies, and its output (SiLU's input)
    query_keys = FP32 * channels if e == FP32 else 2 * FP32 * key_heads * dk  # what the L2 norms read
    query_keys += 2 * FP32 * key_heads  # their rsqrt
    decays = 4 * FP32 * value_heads  # beta, g, softplus's input and output
    rule_inputs = 2 * FP32 * value_heads * dk + e * value_heads * dv  # q and k repeated to the value heads, v
    output = 5 * FP32 * value_heads * dv + FP32 * value_heads + e * value_heads * dv
    return convolution + query_keys + decays + rule_inputs + output


def saved_bytes(config: Config, spec: LayerSpec) -> int:
    return micro_batch_tokens(config)[0] * gated_delta_net_bytes(config)


KIND = Kind(build, flops, saved_bytes)
