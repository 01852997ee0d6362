"""The model FLOPs of one trained token: the numerator of MFU, shared by the training log and the planner."""

from __future__ import annotations

import math

from megatron_lite.config.layer_pattern import linear_attention_pattern, window_attention_pattern
from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.mla import mla_projection_weights
from megatron_lite.model.linear_attention.delta_rule import CHUNK_SIZE
from megatron_lite.model.moe.layer import moe_layer_numbers


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
    projection, a layer (with the last decoder layer's kind of MLP) and the output layer. Backward costs twice
    the forward. Activation recomputation is not counted: it is work the hardware does, not work the model
    needs, so MFU stays comparable between runs with and without it.
    """
    h, s, L = config.hidden_size, config.seq_length, config.num_layers
    q, kv = config.num_attention_heads * config.head_dim, config.num_query_groups * config.head_dim
    attention_weights = h * q * (2 if config.attention_output_gate else 1) + 2 * h * kv + q * h
    attention_square = 4 * s * q
    if config.multi_latent_attention:
        attention_weights = mla_projection_weights(config)
        q_dims = config.qk_head_dim + config.qk_pos_emb_head_dim
        attention_square = 2 * s * config.num_attention_heads * (q_dims + config.v_head_dim)
    mlp_matrices = 3 if config.gated_linear_unit else 2
    dense_mlp = mlp_matrices * h * config.ffn_hidden_size
    moe_mlp = 0
    if config.num_experts:
        moe_mlp = config.moe_router_topk * mlp_matrices * h * config.moe_ffn_hidden_size + h * config.num_experts
        if config.moe_shared_expert_intermediate_size:  # and its gate
            moe_mlp += mlp_matrices * h * config.moe_shared_expert_intermediate_size + h * config.moe_shared_expert_gate
    mlp_of = {number: moe_mlp for number in moe_layer_numbers(config)}  # MoE layers, MTP layers included
    mlp_weights = sum(mlp_of.get(number, dense_mlp) for number in range(L))
    linear = linear_attention_pattern(config)
    softmax_layers = L - sum(linear)
    forward = 2 * (softmax_layers * attention_weights + mlp_weights + h * config.vocab_size)
    forward += softmax_layers * attention_square
    if config.window_size is not None:  # the windowed softmax layers' queries see LEFT + 1 keys, not seq
        windowed = sum(w and not is_linear for w, is_linear in zip(window_attention_pattern(config), linear))
        forward -= windowed * 4 * (s - min(config.window_size[0] + 1, s)) * q
    if any(linear):
        linear_weights, mixing = gated_delta_net_flops(config)
        forward += sum(linear) * (2 * linear_weights + mixing)
    for number in range(L, L + (config.mtp_num_layers or 0)):
        forward += 2 * (2 * h * h + attention_weights + mlp_of.get(number, dense_mlp) + h * config.vocab_size)
        forward += attention_square
    return forward * 3
