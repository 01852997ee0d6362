"""Softmax attention (model/attention/self_attention.py): GQA, RoPE, a sliding window, sinks, an output gate.

Saved per token of the rank's micro-batch beyond the QKV projection's input, with e the bytes of an activation
and tp-local heads (nh query heads, ng groups, head size d):
  QKV output                     e (nh + 2 ng) d, kept alive by the value heads attention saves
  rotated q and k (RoPE)         e (nh + ng) d; without RoPE the query copy e nh d
  attention output               e nh d (also the output projection's input) and a 4-byte log-sum-exp per head
  output gate (Qwen3-Next)       its rows in the QKV output, e nh d more; sigmoid(gate) and the gated output,
                                 2 e nh d
  materialised attention         a layer with a window, or any with sinks (window_and_sinks.py), instead of the
                                 QKV output, rotated q and k, and log-sum-exp: an fp32 copy of q, k and v repeated
                                 to the query heads in fp32 over the sequence's s keys, the fp32 probabilities
                                 over s keys (and the sink), 4 nh (s + 1), and the bool mask, s x s per
                                 micro-batch (per sequence with documents); under context parallelism the rank's
                                 s/cp queries over the gathered s keys, as p2p, allgather and a2a+p2p save them
                                 (a2a keeps k and v of nh / cp heads instead)
Selective recomputation keeps only the core's inputs and output (no log-sum-exp).
"""

from __future__ import annotations

from megatron_lite.config.layer_specs import LayerSpec
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.model.attention.self_attention import SelfAttention
from megatron_lite.model.kinds.activation_terms import FP32, micro_batch_tokens, param_bytes
from megatron_lite.model.kinds.kind import Kind


def build(config, pstate, number, spec, parts):
    return SelfAttention(config, pstate, sequence_parallel=parts.sequence_parallel, backend=parts.backend,
                         rng_tracker=parts.rng_tracker, cp_comm_type=parts.cp_comm_type, fp8=parts.fp8,
                         window=spec.window)


def flops(config: ModelConfig, spec: LayerSpec) -> float:
    """QKV (and the output gate's rows) and the output projection; the scores and weighted sum over the keys a
    query sees: all seq of them (the full square, as Megatron counts it), or the window's LEFT + 1."""
    s, h = config.seq_length, config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_query_groups * config.head_dim
    weights = h * q * (2 if config.attention_output_gate else 1) + 2 * h * kv + q * h
    keys = s if spec.window is None else min(spec.window + 1, s)
    return 2 * weights + 4 * keys * q


def softmax_attention_bytes(config: Config, materialised: bool) -> int:
    """Bytes one micro-batch saves in softmax attention beyond the QKV projection's input (module docstring): by a
    fused kernel, or `materialised` by window_and_sinks.py's attention (a layer with a window, or any with sinks).
    Recomputed (selective), either core keeps only its inputs and output."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    e = param_bytes(config)
    tokens = micro_batch_tokens(config)[0]
    d, nh, ng = m.head_dim, m.num_attention_heads // tp, m.num_query_groups // tp
    gate = e * 2 * nh * d if m.attention_output_gate else 0  # sigmoid(gate) and the gated output
    if not materialised or m.recompute_granularity == "selective":
        lse = 0 if m.recompute_granularity == "selective" else FP32 * nh
        query_rows = nh * (2 if m.attention_output_gate else 1)
        per_token = e * (query_rows + 2 * ng) * d  # QKV output
        per_token += e * (nh + ng) * d if m.rotary_position_embeddings else e * nh * d
        return tokens * (per_token + e * nh * d + lse + gate)
    keys = m.seq_length  # every query's row of scores spans the whole sequence (gathered under CP)
    batch = config.training.micro_batch_size
    sinks = m.softmax_type != "vanilla"
    per_token = FP32 * nh * d + FP32 * nh * (keys + sinks) + e * nh * d + gate  # fp32 q, probabilities, output
    key_values = 2 * FP32 * nh * d * batch * keys  # fp32 k and v, repeated to the query heads
    per_row = config.data.reset_attention_mask or config.data.sft  # documents: a mask per row; else one for all
    mask = tokens // batch * keys * (batch if per_row else 1)  # bool
    return tokens * per_token + key_values + mask


def saved_bytes(config: Config, spec: LayerSpec) -> int:
    """By a fused kernel, or by window_and_sinks.py's materialised scores (a window, or sinks)."""
    return softmax_attention_bytes(config, config.model.softmax_type != "vanilla" or spec.window is not None)


KIND = Kind(build, flops, saved_bytes)
