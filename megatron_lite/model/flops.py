"""The model FLOPs of one trained token: the numerator of MFU, shared by the training log and the planner."""

from __future__ import annotations

import math

from megatron_lite.config.layer_specs import (
    ATTENTION,
    DENSE,
    GATED_DELTA_NET,
    LATENT_ATTENTION,
    MOE,
    LayerSpec,
    numbered_layer_specs,
)
from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.mla import mla_projection_weights
from megatron_lite.model.linear_attention.delta_rule import CHUNK_SIZE


def gated_delta_net_flops(config: ModelConfig) -> tuple[int, float]:
    """(weights, mixing FLOPs per token) of one Gated DeltaNet layer's forward: the weights of its input and output
    projections, and the matrix products of the chunked delta rule (delta_rule.py) for each value head, over the
    sequence padded to whole chunks of C (64, or the sequence when shorter): per token within its chunk q k^T and
    k k^T (2 C dk each), the scores times the corrections (2 C dv), and three products with the [dk, dv] state
    (read by the corrections and the queries, written once: 6 dk dv). The two triangular solves are not counted
    (nor by torch's FLOP counter)."""
    h, C = config.hidden_size, min(CHUNK_SIZE, config.seq_length)
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    weights = h * (2 * keys + 2 * values + 2 * config.linear_num_value_heads) + values * h
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    padded = math.ceil(config.seq_length / C) * C / config.seq_length
    mixing = config.linear_num_value_heads * (4 * C * dk + 2 * C * dv + 6 * dk * dv) * padded
    return weights, mixing


def training_flops_per_token(config: ModelConfig) -> float:
    """Model FLOPs to train on one token, counting matrix multiplies only (as PaLM's MFU, appendix B).

    Forward: 2 FLOPs per weight of every linear layer (QKV and the output gate's rows, attention output, MLP or
    the top-k experts a token visits and the shared expert, output layer) plus the attention scores and weighted sum,
    2 * 2 * seq * hidden per layer (the full square, as Megatron counts it; heads x head size stands for
    hidden where --kv-channels sets another head size; a layer with --window-size LEFT 0 counts the LEFT + 1 keys
    a query may see, where fewer than seq; with multi-latent attention its projections, and
    2 * seq * heads * (query-key + value head dims); a Gated DeltaNet layer instead its projections and
    `gated_delta_net_flops`' products); each multi-token prediction depth adds its 2h -> h
    projection, a layer of the last decoder layer's kind and the output layer. Each kind's share is in the tables
    MIXER_FLOPS and MLP_FLOPS, summed over the layer specs (config/layer_specs.py). Backward costs twice
    the forward. Activation recomputation is not counted: it is work the hardware does, not work the model
    needs, so MFU stays comparable between runs with and without it.
    """
    h = config.hidden_size
    forward = sum(MIXER_FLOPS[spec.mixer](config, spec) + MLP_FLOPS[spec.mlp](config)
                  for spec in numbered_layer_specs(config))
    forward += 2 * (config.mtp_num_layers or 0) * 2 * h * h  # each depth's 2h -> h projection
    forward += 2 * (1 + (config.mtp_num_layers or 0)) * h * config.vocab_size  # the output layer, once per depth too
    return forward * 3


def _softmax_attention(config: ModelConfig, spec: LayerSpec) -> float:
    """QKV (and the output gate's rows) and the output projection; the scores and weighted sum over the keys a
    query sees: all seq of them (the full square, as Megatron counts it), or the window's LEFT + 1."""
    s, h = config.seq_length, config.hidden_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_query_groups * config.head_dim
    weights = h * q * (2 if config.attention_output_gate else 1) + 2 * h * kv + q * h
    keys = s if spec.window is None else min(spec.window + 1, s)
    return 2 * weights + 4 * keys * q


def _latent_attention(config: ModelConfig, spec: LayerSpec) -> float:
    q_dims = config.qk_head_dim + config.qk_pos_emb_head_dim
    return (2 * mla_projection_weights(config)
            + 2 * config.seq_length * config.num_attention_heads * (q_dims + config.v_head_dim))


def _gated_delta_net(config: ModelConfig, spec: LayerSpec) -> float:
    weights, mixing = gated_delta_net_flops(config)
    return 2 * weights + mixing


def _dense_mlp(config: ModelConfig) -> float:
    return 2 * (3 if config.gated_linear_unit else 2) * config.hidden_size * config.ffn_hidden_size


def _moe_mlp(config: ModelConfig) -> float:
    """The top-k experts a token visits, the router, and the shared expert and its gate."""
    h, matrices = config.hidden_size, 3 if config.gated_linear_unit else 2
    weights = config.moe_router_topk * matrices * h * config.moe_ffn_hidden_size + h * config.num_experts
    if config.moe_shared_expert_intermediate_size:
        weights += matrices * h * config.moe_shared_expert_intermediate_size + h * config.moe_shared_expert_gate
    return 2 * weights


# Forward FLOPs per token of each kind of token mixer and MLP (config/layer_specs.py)
MIXER_FLOPS = {ATTENTION: _softmax_attention, LATENT_ATTENTION: _latent_attention, GATED_DELTA_NET: _gated_delta_net}
MLP_FLOPS = {DENSE: _dense_mlp, MOE: _moe_mlp}
