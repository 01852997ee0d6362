"""The parameters one rank's model chunk holds, as shapes: what the model builds, without building it.

The shapes of each chunk follow `module.parameters()` order (model/gpt.py, transformer.py, attention/, mlp.py,
moe/, mtp.py: a module's own parameters before its children's): the vocabulary padded to a multiple of
--make-vocab-size-divisible-by x TP; attention and dense MLP weights split over TP; an MoE layer's router
replicated, its E / ep routed experts split over the expert-tensor-parallel ranks (--expert-tensor-parallel-size,
TP by default) and its shared expert over TP; a Gated DeltaNet layer's heads split over TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.layer_pattern import LayerKind, layer_kind, layer_kinds
from megatron_lite.config.layer_split import ChunkPlan
from megatron_lite.config.sections import Config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.planning.shared_cache import shapes_key, shared


@dataclass(frozen=True)
class ParamShape:
    """One local parameter as the gradient buffers see it."""

    numel: int
    expert: bool = False
    unit: int = -1  # ZeRO-3 gathering unit: the chunk-local layer index, -1 for the rest of the chunk
    isolated: bool = False  # the tied-embedding copy that the first and last stage keep equal
    muon: bool = False  # a hidden weight matrix, which --optimizer muon steps (optim/muon_optimizer.py)


class _NotMuon(int):
    """The element count of a layer parameter that --optimizer muon leaves to AdamW: a norm, a bias, the router,
    the shared expert's gate (every other layer parameter is a hidden weight matrix)."""


def expert_tensor_parallel_size(config: Config) -> int:
    """The ranks splitting each routed expert's weights: --expert-tensor-parallel-size, else TP (Megatron's)."""
    p = config.parallel
    return p.expert_tensor_parallel_size or p.tensor_model_parallel_size


def _linear(out_features: int, in_features: int, bias: bool, tp_dim: int | None, tp: int) -> list[int]:
    """Weight [out, in] (split over TP along tp_dim) and optional bias [out] (split with a column split)."""
    out_local = out_features // tp if tp_dim == 0 else out_features
    in_local = in_features // tp if tp_dim == 1 else in_features
    return [out_local * in_local] + ([_NotMuon(out_local)] if bias else [])


def _norm(config: Config, size: int) -> list[int]:
    return [_NotMuon(size)] * (2 if config.model.normalization == "LayerNorm" else 1)


def _latent_attention_params(config: Config) -> list[int]:
    """Multi-latent attention's parameters in registration order (model/attention/mla.py): heads split over TP, the
    down-projections and latent norms whole on every rank."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    h, heads = m.hidden_size, m.num_attention_heads // tp
    norm = (lambda size: _norm(config, size)) if m.qk_layernorm else (lambda size: [])
    q_width = heads * (m.qk_head_dim + m.qk_pos_emb_head_dim)
    if m.q_lora_rank is None:
        params = [q_width * h]
    else:
        params = [m.q_lora_rank * h, *norm(m.q_lora_rank), q_width * m.q_lora_rank]
    params += [(m.kv_lora_rank + m.qk_pos_emb_head_dim) * h, *norm(m.kv_lora_rank),
               heads * (m.qk_head_dim + m.v_head_dim) * m.kv_lora_rank]
    return params + [h * heads * m.v_head_dim]


def _gated_delta_net_params(config: Config) -> list[int]:
    """Gated DeltaNet's parameters in registration order (model/linear_attention/gated_delta_net.py), its own before
    its linears': the convolution, A_log and dt_bias split by heads over TP, the output norm's weight whole on
    every rank, then the input and output projections. Muon steps the two projections alone (the convolution's
    weight is 3-D)."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    key_heads, value_heads = m.linear_num_key_heads // tp, m.linear_num_value_heads // tp
    keys, values = key_heads * m.linear_key_head_dim, value_heads * m.linear_value_head_dim
    projection = (2 * keys + 2 * values + 2 * value_heads) * m.hidden_size
    return [_NotMuon((2 * keys + values) * m.linear_conv_kernel_dim), _NotMuon(value_heads), _NotMuon(value_heads),
            _NotMuon(m.linear_value_head_dim), projection, m.hidden_size * values]


def layer_numels(config: Config, kind: LayerKind) -> tuple[list[int], list[int]]:
    """One TransformerLayer's element counts in registration order: the dense parameters (norms, biases, the
    router and the shared expert's gate as _NotMuon) and the routed experts' (`kind.moe`)."""
    m, tp, ep = config.model, config.parallel.tensor_model_parallel_size, config.parallel.expert_model_parallel_size
    etp = expert_tensor_parallel_size(config)
    h, d = m.hidden_size, m.head_dim
    bias = not m.disable_bias_linear
    moe = kind.moe
    if kind.linear_attention:
        dense = [*_norm(config, h), *_gated_delta_net_params(config)]
    elif m.multi_latent_attention:
        dense = [*_norm(config, h), *_latent_attention_params(config)]
    else:
        query_rows = m.num_attention_heads * (2 if m.attention_output_gate else 1)  # and the gates
        sinks = [_NotMuon(m.num_attention_heads // tp)] if m.softmax_type == "learnable" else []
        dense = [*_norm(config, h), *sinks, *_linear((query_rows + 2 * m.num_query_groups) * d, h,
                                                     bias or m.add_qkv_bias, 0, tp)]
        if m.qk_layernorm:
            dense += _norm(config, d) * 2
        dense += _linear(h, m.num_attention_heads * d, bias, 1, tp)
    dense += _norm(config, h)
    chunks = 2 if m.gated_linear_unit else 1
    expert = []
    if moe:
        dense += [_NotMuon(m.num_experts * h)] + ([_NotMuon(m.num_experts)] if bias else [])  # router, replicated
        ffn = m.moe_ffn_hidden_size  # each local expert's fc1 and fc2 (and biases), split over ETP
        expert = (_linear(chunks * ffn, h, bias, 0, etp) + _linear(h, ffn, bias, 1, etp)) * (m.num_experts // ep)
        shared = m.moe_shared_expert_intermediate_size
        if shared:  # split over TP as the dense MLP, no biases; its gate replicated
            dense += [chunks * shared // tp * h, h * (shared // tp)] + ([_NotMuon(h)] if m.moe_shared_expert_gate
                                                                       else [])
    else:
        dense += _linear(chunks * m.ffn_hidden_size, h, bias, 0, tp) + _linear(h, m.ffn_hidden_size, bias, 1, tp)
    return dense, expert


def _layer_params(config: Config, layer_number: int, unit: int) -> list[ParamShape]:
    """One TransformerLayer's parameters in registration order."""
    dense, expert = layer_numels(config, layer_kind(config.model, layer_number))
    return ([ParamShape(n, unit=unit, muon=not isinstance(n, _NotMuon)) for n in dense]
            + [ParamShape(n, expert=True, unit=unit, muon=not isinstance(n, _NotMuon)) for n in expert])


def _vocab_rows(config: Config) -> int:
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    return padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp


def front_params(config: Config, chunk: ChunkPlan) -> list[ParamShape]:
    """A chunk's parameters before its layers: the embedding on the first stage, and the copies of its tables the
    last stage keeps for multi-token prediction."""
    m = config.model
    tied = not m.untie_embeddings_and_output_weights
    split_tied = tied and chunk.pre_process != chunk.post_process
    split_mtp = bool(m.mtp_num_layers) and chunk.pre_process != chunk.post_process  # tables tied to the other end
    params = []
    if chunk.pre_process or (chunk.post_process and m.mtp_num_layers):  # MTP reads the embedding
        if m.position_embedding_type == "learned_absolute":  # the Embedding's own parameter, before its child's
            params.append(ParamShape(m.max_position_embeddings * m.hidden_size, isolated=split_mtp))
        params.append(ParamShape(_vocab_rows(config) * m.hidden_size, isolated=split_tied or split_mtp))
    return params


def back_params(config: Config, chunk: ChunkPlan) -> list[ParamShape]:
    """A chunk's parameters after its layers: on the last stage the final norm, the output layer (unless tied to
    this stage's table) and the multi-token prediction modules (with routed experts where the last layer has
    them)."""
    m = config.model
    if not chunk.post_process:
        return []
    tied = not m.untie_embeddings_and_output_weights
    mtp = bool(m.mtp_num_layers)
    params = [ParamShape(n) for n in _norm(config, m.hidden_size)]
    if not (tied and (chunk.pre_process or mtp)):  # tied embeddings: the output reads this stage's table
        params.append(ParamShape(_vocab_rows(config) * m.hidden_size, isolated=tied and not chunk.pre_process))
    for depth in range(1, (m.mtp_num_layers or 0) + 1):
        params += mtp_layer_params(config, m.num_layers + depth - 1)
    return params


def chunk_params(config: Config, chunk: ChunkPlan) -> list[ParamShape]:
    """A GPTModel chunk's parameters in `module.parameters()` order."""
    params = front_params(config, chunk)
    for index in range(chunk.num_layers):
        params += _layer_params(config, chunk.layer_offset + index, index)
    return params + back_params(config, chunk)


def chunk_layer_kinds(config: Config, chunk: ChunkPlan) -> list[LayerKind]:
    """The kind of each layer of the chunk."""
    return layer_kinds(config.model)[chunk.layer_offset:chunk.layer_offset + chunk.num_layers]


def chunk_numels(config: Config, chunk: ChunkPlan) -> tuple[int, int]:
    """(dense, routed expert) parameter elements of a chunk, each layer kind counted once."""
    def count() -> tuple[int, int]:
        kinds = chunk_layer_kinds(config, chunk)
        ends = front_params(config, chunk) + back_params(config, chunk)
        dense = sum(param.numel for param in ends if not param.expert)
        expert = sum(param.numel for param in ends if param.expert)
        for kind in set(kinds):
            layers = kinds.count(kind)
            layer_dense, layer_expert = layer_numels(config, kind)
            dense, expert = dense + layers * sum(layer_dense), expert + layers * sum(layer_expert)
        return dense, expert

    key = ("chunk numels", shapes_key(config), chunk.layer_offset, chunk.num_layers, chunk.pre_process,
           chunk.post_process)
    return shared(key, count)


def mtp_layer_params(config: Config, layer_number: int) -> list[ParamShape]:
    """One multi-token prediction module's parameters (model/mtp.py): two norms, the 2h -> h projection (split
    over TP by output rows, a hidden matrix for Muon), a transformer layer numbered `layer_number` (after the
    decoder's: its MLP of the last decoder layer's kind), and its final norm; all in the chunk's own ZeRO-3 unit."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    norms = [ParamShape(n) for n in _norm(config, m.hidden_size)]
    projection = ParamShape(m.hidden_size // tp * 2 * m.hidden_size, muon=True)
    return [*norms, *norms, projection, *_layer_params(config, layer_number, -1), *norms]
