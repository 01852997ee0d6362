"""Bytes of parameters, gradients and optimizer state one rank holds between steps, as the code lays them out.

The prediction retraces what the model and optimizer build, without building them: the parameter shapes
of each model chunk in `module.parameters()` order (model/gpt.py, transformer.py, attention.py, mlp.py,
moe.py: a module's own parameters before its children's), the vocabulary padded to a multiple of
--make-vocab-size-divisible-by x TP, the buckets of optim/data_parallel.py (parameters in reverse order,
about --ddp-bucket-size elements each, never spanning two ZeRO-3 units, the isolated tied-embedding copy,
each padded to a multiple of its data-parallel group: with --num-distributed-optimizer-instances N, of one
instance's dp x cp / N ranks) and what each ZeRO stage keeps of them:

  params     no_shard: every parameter in its own storage; optim/optim_grads: each bucket's padded buffer;
             optim_grads_params: this rank's shard of each bucket (parameter dtype)
  grads      fp32; the padded buckets (no_shard, optim) or this rank's shards (optim_grads(_params))
  optimizer  fp32 masters of bf16/fp16 weights and two fp32 Adam moments, for every element this rank steps:
             whole parameters (no_shard) or its part of each bucket's real elements (sharded)

With --optimizer-cpu-offload the optimizer's leading owned ranges (its order: whole parameters chunk by
chunk in no_shard, else each bucket's parameters met by this rank's shard) whose elements come nearest
--optimizer-offload-fraction of all it steps live in host memory (optim/cpu_offload.py). Each of their
elements costs the host an fp32 master (also for an fp32 weight), two fp32 moments, an fp32 gradient
buffer and, for bf16/fp16 weights, a copy in the weight's dtype; the device keeps the other ranges' state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_lite.config import Config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.model.layer_pattern import is_moe_layer
from megatron_lite.optim.cpu_offload import offloaded_count
from megatron_lite.optim.zero_stage import ZeroStage
from megatron_lite.pipeline.layer_split import ChunkPlan, model_chunk_plans

FP32 = 4


@dataclass(frozen=True)
class ParamShape:
    """One local parameter as the gradient buffers see it."""

    numel: int
    expert: bool = False
    unit: int = -1  # ZeRO-3 gathering unit: the chunk-local layer index, -1 for the rest of the chunk
    isolated: bool = False  # the tied-embedding copy that the first and last stage keep equal
    muon: bool = False  # a hidden weight matrix, which --optimizer muon steps (optim/muon_optimizer.py)


@dataclass
class StateBytes:
    """Bytes one rank holds between steps (device), and the optimizer's bytes in host memory."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    optimizer_on_host: int = 0
    numel: int = 0  # local parameter elements (what the model's parameters() count)
    offloaded: int = 0  # elements stepped on the host

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def param_bytes(config: Config) -> int:
    """Bytes per model weight: 2 with --bf16/--fp16, else 4."""
    o = config.optimizer
    return 2 if (o.bf16 or o.fp16) else FP32


def zero_stage_of(config: Config) -> ZeroStage:
    """The ZeRO stage of --data-parallel-sharding-strategy, whose properties say what a rank keeps."""
    return ZeroStage(config.parallel.data_parallel_sharding_strategy)


class _NotMuon(int):
    """The element count of a layer parameter that --optimizer muon leaves to AdamW: a norm, a bias, the router,
    the shared expert's gate (every other layer parameter is a hidden weight matrix)."""


def _linear(out_features: int, in_features: int, bias: bool, tp_dim: int | None, tp: int) -> list[int]:
    """Weight [out, in] (split over TP along tp_dim) and optional bias [out] (split with a column split)."""
    out_local = out_features // tp if tp_dim == 0 else out_features
    in_local = in_features // tp if tp_dim == 1 else in_features
    return [out_local * in_local] + ([_NotMuon(out_local)] if bias else [])


def _norm(config: Config, size: int) -> list[int]:
    return [_NotMuon(size)] * (2 if config.model.normalization == "LayerNorm" else 1)


def _latent_attention_params(config: Config) -> list[int]:
    """Multi-latent attention's parameters in registration order (model/mla.py): heads split over TP, the
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


def _layer_params(config: Config, layer_number: int, unit: int) -> list[ParamShape]:
    """One TransformerLayer's parameters in registration order."""
    m, tp, ep = config.model, config.parallel.tensor_model_parallel_size, config.parallel.expert_model_parallel_size
    h, d = m.hidden_size, m.head_dim
    bias = not m.disable_bias_linear
    if m.multi_latent_attention:
        dense = [*_norm(config, h), *_latent_attention_params(config)]
    else:
        dense = [*_norm(config, h), *_linear((m.num_attention_heads + 2 * m.num_query_groups) * d, h,
                                             bias or m.add_qkv_bias, 0, tp)]
        if m.qk_layernorm:
            dense += _norm(config, d) * 2
        dense += _linear(h, m.num_attention_heads * d, bias, 1, tp)
    dense += _norm(config, h)
    chunks = 2 if m.swiglu else 1
    expert = []
    if is_moe_layer(m, layer_number):
        dense.append(_NotMuon(m.num_experts * h))  # the router, replicated
        for _ in range(m.num_experts // ep):
            expert += [chunks * m.moe_ffn_hidden_size // tp * h, h * (m.moe_ffn_hidden_size // tp)]
        shared = m.moe_shared_expert_intermediate_size
        if shared:  # split over TP as the dense MLP, no biases; its gate replicated
            dense += [chunks * shared // tp * h, h * (shared // tp)] + ([_NotMuon(h)] if m.moe_shared_expert_gate
                                                                       else [])
    else:
        dense += _linear(chunks * m.ffn_hidden_size, h, bias, 0, tp) + _linear(h, m.ffn_hidden_size, bias, 1, tp)
    return ([ParamShape(n, unit=unit, muon=not isinstance(n, _NotMuon)) for n in dense]
            + [ParamShape(n, expert=True, unit=unit, muon=True) for n in expert])


def chunk_params(config: Config, chunk: ChunkPlan) -> list[ParamShape]:
    """A GPTModel chunk's parameters in `module.parameters()` order."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    vocab_rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    tied = not m.untie_embeddings_and_output_weights
    split_tied = tied and chunk.pre_process != chunk.post_process
    split_mtp = bool(m.mtp_num_layers) and chunk.pre_process != chunk.post_process  # tables tied to the other end
    mtp = chunk.post_process and bool(m.mtp_num_layers)
    params = []
    if chunk.pre_process or mtp:  # multi-token prediction reads the embedding: the last stage holds a copy
        if m.position_embedding_type == "learned_absolute":  # the Embedding's own parameter, before its child's
            params.append(ParamShape(m.max_position_embeddings * m.hidden_size, isolated=split_mtp))
        params.append(ParamShape(vocab_rows * m.hidden_size, isolated=split_tied or split_mtp))
    for index in range(chunk.num_layers):
        params += _layer_params(config, chunk.layer_offset + index, index)
    if chunk.post_process:
        params += [ParamShape(n) for n in _norm(config, m.hidden_size)]
        if not (tied and (chunk.pre_process or mtp)):  # tied embeddings: the output reads this stage's table
            params.append(ParamShape(vocab_rows * m.hidden_size, isolated=split_tied))
    if mtp:
        params += mtp_layer_params(config) * m.mtp_num_layers
    return params


def mtp_layer_params(config: Config) -> list[ParamShape]:
    """One multi-token prediction module's parameters (model/mtp.py): two norms, the 2h -> h projection (split
    over TP by output rows, a hidden matrix for Muon), a transformer layer with a dense MLP, and its final norm."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    dense = dataclasses.replace(config, model=dataclasses.replace(m, num_experts=None))
    norms = [ParamShape(n) for n in _norm(config, m.hidden_size)]
    projection = ParamShape(m.hidden_size // tp * 2 * m.hidden_size, muon=True)
    return [*norms, *norms, projection, *_layer_params(dense, 0, -1), *norms]


def _cut_buckets(params: list[ParamShape], bucket_size: int, zero3: bool) -> list[list[ParamShape]]:
    """param_and_grad_buffer.cut_buckets on shapes: consecutive parameters (in backward order) up to about bucket_size
    elements, a new bucket at every ZeRO-3 unit boundary and around each isolated parameter."""
    buckets, current, size = [], [], 0
    for param in params:
        if current and (size >= bucket_size or param.isolated or current[-1].isolated
                        or (zero3 and param.unit != current[-1].unit)):
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel
    if current:
        buckets.append(current)
    return buckets


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class BucketShape:
    """One bucket of a chunk's gradient buffers, as optim/param_and_grad_buffer.py cuts it."""

    real: int  # parameter elements
    numel: int  # padded to a multiple of its data-parallel group
    expert: bool
    unit: int  # the ZeRO-3 unit of its parameters (-1: the chunk outside its layers)


def _chunk_bucket_params(config: Config, chunk: ChunkPlan) -> list[tuple[bool, list[ParamShape]]]:
    """Each bucket of one model chunk as (expert, its parameters in buffer order), in backward order, dense
    ones first."""
    p = config.parallel
    params = chunk_params(config, chunk)
    buckets = []
    for expert in (False, True):
        members = [param for param in params if param.expert == expert][::-1]
        for bucket in _cut_buckets(members, p.ddp_bucket_size, zero_stage_of(config).shards_params
                                   ) if members else []:
            buckets.append((expert, bucket))
    return buckets


def _group_sizes(config: Config) -> dict[bool, int]:
    """The group dense (False) and expert (True) buckets are padded to and sharded over: the data-parallel ranks of
    one distributed-optimizer instance (all of them with one instance)."""
    p = config.parallel
    dense_group = p.data_parallel_size * p.context_parallel_size // p.num_distributed_optimizer_instances
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    expert_group = dense_group * p.tensor_model_parallel_size // (etp * p.expert_model_parallel_size)
    return {False: dense_group, True: expert_group}


def chunk_buckets(config: Config, chunk: ChunkPlan) -> list[BucketShape]:
    """The buckets of one model chunk in backward order, dense ones first."""
    groups = _group_sizes(config)
    buckets = []
    for expert, bucket in _chunk_bucket_params(config, chunk):
        real = sum(param.numel for param in bucket)
        buckets.append(BucketShape(real, _round_up(real, groups[expert]), expert, bucket[0].unit))
    return buckets


def owned_range_numels(config: Config, chunk: ChunkPlan, dp_rank: int = 0) -> list[int]:
    """Elements of each range the optimizer steps for one model chunk, in its order: every parameter whole
    (no_shard), else each bucket's parameters cut to the part inside this rank's shard (empty parts left out)."""
    return [numel for numel, _ in owned_ranges(config, chunk, dp_rank)]


def owned_ranges(config: Config, chunk: ChunkPlan, dp_rank: int = 0) -> list[tuple[int, ParamShape]]:
    """owned_range_numels with the parameter each range belongs to."""
    p = config.parallel
    if not zero_stage_of(config).shards_optimizer_state:
        return [(param.numel, param) for param in chunk_params(config, chunk)]
    groups = _group_sizes(config)
    numels = []
    for expert, bucket in _chunk_bucket_params(config, chunk):
        shard = _round_up(sum(param.numel for param in bucket), groups[expert]) // groups[expert]
        index = dp_rank // p.expert_model_parallel_size if expert else dp_rank
        shard_start = index % groups[expert] * shard  # the same shard in every distributed-optimizer instance
        offset = 0
        for param in bucket:
            owned = min(shard_start + shard, offset + param.numel) - max(shard_start, offset)
            if owned > 0:
                numels.append((owned, param))
            offset += param.numel
    return numels


def chunk_state_bytes(config: Config, chunk: ChunkPlan, dp_rank: int = 0) -> StateBytes:
    """The parameters and gradients one model chunk costs the rank at index `dp_rank` of its dp x cp group
    (its index in the expert-data-parallel group is dp_rank // ep, as parallel/state.py orders ranks). Index 0
    holds the most: the padding of a bucket falls in the last ranks' shards. The optimizer's elements are
    owned_range_numels'."""
    stage = zero_stage_of(config)
    weight = param_bytes(config)
    groups = _group_sizes(config)
    state = StateBytes(numel=sum(param.numel for param in chunk_params(config, chunk)))
    for bucket in chunk_buckets(config, chunk):
        shard = bucket.numel // groups[bucket.expert]
        if not stage.shards_optimizer_state:
            state.params += bucket.real * weight
            state.grads += bucket.numel * FP32
            continue
        state.params += (shard if stage.shards_params else bucket.numel) * weight
        state.grads += (shard if stage.shards_grads else bucket.numel) * FP32
    return state


def _device_optimizer_bytes(config: Config) -> int:
    """Per element stepped on the device: two fp32 moments and, for a bf16/fp16 weight, its fp32 master."""
    return 2 * FP32 + (0 if param_bytes(config) == FP32 else FP32)


def host_optimizer_bytes(config: Config) -> int:
    """Per element stepped on the host: fp32 master, two fp32 moments, fp32 gradient, and for a bf16/fp16
    weight the copy that crosses to the device."""
    weight = param_bytes(config)
    return 4 * FP32 + (0 if weight == FP32 else weight)


def stage_state_bytes(config: Config, pp_rank: int, dp_rank: int = 0, offload_fraction: float = 0.0) -> StateBytes:
    """Parameters, gradients and optimizer state of a rank of pipeline stage `pp_rank`, all its chunks, with
    the leading owned ranges nearest `offload_fraction` of its optimizer elements held on the host."""
    total = StateBytes()
    ranges, matrices = [], []
    for chunk in model_chunk_plans(config, pp_rank):
        part = chunk_state_bytes(config, chunk, dp_rank)
        for name in ("params", "grads", "numel"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        ranges += owned_range_numels(config, chunk, dp_rank)
        matrices += [(n, param) for n, param in owned_ranges(config, chunk, dp_rank) if param.muon]
    if config.optimizer.optimizer == "muon":
        total.optimizer = muon_optimizer_bytes(config, sum(ranges), matrices, model_chunk_plans(config, pp_rank))
        return total
    if offload_fraction:
        total.offloaded = sum(ranges[:offloaded_count(ranges, offload_fraction)])
    total.optimizer = (sum(ranges) - total.offloaded) * _device_optimizer_bytes(config)
    total.optimizer_on_host = total.offloaded * host_optimizer_bytes(config)
    return total


def muon_optimizer_bytes(config: Config, stepped: int, matrices: list[tuple[int, ParamShape]], chunks) -> int:
    """--optimizer muon (no offload): per stepped element the fp32 master of a bf16/fp16 weight; two fp32 Adam
    moments, or one fp32 momentum buffer for an element of a Muon matrix. Under the distributed optimizer a rank
    also holds, during the step, the whole fp32 matrices it orthogonalises (a direction and an update each):
    counted as 1/d of the stage's Muon matrices plus its largest, an estimate (owners are balanced by
    Newton-Schulz FLOPs, not bytes), and under --muon-tp-mode duplicated one matrix gathered over TP."""
    master = 0 if param_bytes(config) == FP32 else FP32
    in_matrices = sum(n for n, _ in matrices)
    total = stepped * master + (stepped - in_matrices) * 2 * FP32 + in_matrices * FP32
    if not zero_stage_of(config).shards_optimizer_state:
        return total
    groups = _group_sizes(config)
    whole = [(param.numel, groups[param.expert]) for chunk in chunks for param in chunk_params(config, chunk)
             if param.muon]
    if not whole:
        return total
    largest = max(numel for numel, _ in whole)
    held = sum(_round_up(numel, group) // group for numel, group in whole) + largest
    tp = config.parallel.tensor_model_parallel_size
    gathered = largest * tp if config.optimizer.muon_tp_mode == "duplicated" and tp > 1 else 0
    return total + (2 * held + gathered) * FP32
