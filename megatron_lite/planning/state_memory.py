"""Bytes of parameters, gradients and optimizer state one rank holds between steps, as the code lays them out.

The prediction retraces what the model and optimizer build, without building them: the parameter shapes of each
model chunk (param_shapes.py), the buckets of optim/data_parallel.py (bucket_tables.py: parameters in reverse
order, about --ddp-bucket-size elements each, never spanning two ZeRO-3 units, the isolated tied-embedding copy,
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

Routed experts (E / ep per rank) are split over the expert-tensor-parallel ranks (--expert-tensor-parallel-size,
TP by default) and replicated over the expert data-parallel ranks, edp = tp x cp x dp / (etp x ep) (MoE parallel
folding, parallel/state.py): their buckets are padded to and sharded over edp / N of them, and a rank's place
there is its stage index tp + TP (cp + CP dp) // (etp x ep). The shared expert stays split over TP.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.layer_split import ChunkPlan, model_chunk_plans
from megatron_lite.config.sections import Config
from megatron_lite.model.kinds.activation_terms import FP32, expert_tensor_parallel_size, param_bytes
from megatron_lite.optim.cpu_offload import offloaded_count
from megatron_lite.optim.zero_stage import ZeroStage
from megatron_lite.planning.bucket_tables import chunk_table, param_buckets
from megatron_lite.planning.param_shapes import ParamShape, chunk_numels, chunk_params


@dataclass
class StateBytes:
    """Bytes one rank holds between steps (device), and the optimizer's bytes in host memory."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    optimizer_on_host: int = 0
    numel: int = 0  # local parameter elements (what the model's parameters() count)
    expert_numel: int = 0  # of which routed experts' (their gradients are reduced over expert data parallel)
    stepped: int = 0  # elements the optimizer steps: whole parameters (no_shard) or this rank's shards
    offloaded: int = 0  # elements stepped on the host

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def zero_stage_of(config: Config) -> ZeroStage:
    """The ZeRO stage of --data-parallel-sharding-strategy, whose properties say what a rank keeps."""
    return ZeroStage(config.parallel.data_parallel_sharding_strategy)


def group_sizes(config: Config) -> tuple[int, int]:
    """The groups dense and expert buckets are padded to and sharded over: the data-parallel ranks of one
    distributed-optimizer instance (all of them with one instance), dp x cp / N and edp / N."""
    p = config.parallel
    dense_group = p.data_parallel_size * p.context_parallel_size // p.num_distributed_optimizer_instances
    expert_group = (dense_group * p.tensor_model_parallel_size
                    // (expert_tensor_parallel_size(config) * p.expert_model_parallel_size))
    return dense_group, expert_group


def _shard_indices(config: Config, dp_rank: int, tp_rank: int) -> tuple[int, int]:
    """A rank's shard of the dense and of the expert buckets: its index within its instance of dp x cp (dp_rank,
    the dp_cp index cp + CP dp) and of the expert data-parallel ranks (stage index tp + TP dp_rank // (etp ep))."""
    p = config.parallel
    dense_group, expert_group = group_sizes(config)
    expert_index = ((tp_rank + p.tensor_model_parallel_size * dp_rank)
                    // (expert_tensor_parallel_size(config) * p.expert_model_parallel_size))
    return dp_rank % dense_group, expert_index % expert_group  # the same shard in every instance


def owned_ranges(config: Config, chunk: ChunkPlan, dp_rank: int = 0, tp_rank: int = 0
                 ) -> list[tuple[int, ParamShape]]:
    """Elements of each range the optimizer steps for one model chunk, in its order, with the parameter each
    belongs to: every parameter whole (no_shard), else each bucket's parameters cut to the part inside this
    rank's shard (empty parts left out)."""
    if not zero_stage_of(config).shards_optimizer_state:
        return [(param.numel, param) for param in chunk_params(config, chunk)]
    groups, indices = group_sizes(config), _shard_indices(config, dp_rank, tp_rank)
    numels = []
    for expert, bucket in param_buckets(config, chunk):
        real = sum(param.numel for param in bucket)
        shard = -(-real // groups[expert])
        shard_start = indices[expert] * shard
        offset = 0
        for param in bucket:
            owned = min(shard_start + shard, offset + param.numel) - max(shard_start, offset)
            if owned > 0:
                numels.append((owned, param))
            offset += param.numel
    return numels


def chunk_state_bytes(config: Config, chunk: ChunkPlan, dp_rank: int = 0, tp_rank: int = 0) -> StateBytes:
    """The parameters and gradients one model chunk costs the rank at index `dp_rank` of its dp x cp group and
    `tp_rank` of its TP group (which fix its place among the expert data-parallel ranks). Index 0 holds the most:
    the padding of a bucket falls in the last ranks' shards. `stepped` counts the elements the optimizer steps."""
    stage = zero_stage_of(config)
    weight = param_bytes(config)
    table = chunk_table(config, chunk)
    state = StateBytes(numel=table.numel, expert_numel=table.expert_numel)
    if not stage.shards_optimizer_state:
        state.params = table.numel * weight
        state.grads = table.sums(group_sizes(config), (0, 0)).padded * FP32
        state.stepped = table.numel
        return state
    sums = table.sums(group_sizes(config), _shard_indices(config, dp_rank, tp_rank))
    state.params = (sums.shards if stage.shards_params else sums.padded) * weight
    state.grads = (sums.shards if stage.shards_grads else sums.padded) * FP32
    state.stepped = sums.owned
    return state


def _device_optimizer_bytes(config: Config) -> int:
    """Per element stepped on the device: two fp32 moments and, for a bf16/fp16 weight, its fp32 master."""
    return 2 * FP32 + (0 if param_bytes(config) == FP32 else FP32)


def host_optimizer_bytes(config: Config) -> int:
    """Per element stepped on the host: fp32 master, two fp32 moments, fp32 gradient, and for a bf16/fp16
    weight the copy that crosses to the device."""
    weight = param_bytes(config)
    return 4 * FP32 + (0 if weight == FP32 else weight)


def stage_state_bytes(config: Config, pp_rank: int, dp_rank: int = 0, offload_fraction: float = 0.0, *,
                      tp_rank: int = 0) -> StateBytes:
    """Parameters, gradients and optimizer state of a rank of pipeline stage `pp_rank` (at index `dp_rank` of its
    dp x cp group and `tp_rank` of its TP group), all its chunks, with the leading owned ranges nearest
    `offload_fraction` of its optimizer elements held on the host."""
    total = StateBytes()
    chunks = model_chunk_plans(config, pp_rank)
    for chunk in chunks:
        part = chunk_state_bytes(config, chunk, dp_rank, tp_rank)
        for name in ("params", "grads", "numel", "expert_numel", "stepped"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
    if config.optimizer.optimizer == "muon":
        matrices = [(n, param) for chunk in chunks for n, param in owned_ranges(config, chunk, dp_rank, tp_rank)
                    if param.muon]
        total.optimizer = muon_optimizer_bytes(config, total.stepped, matrices, chunks)
        return total
    if offload_fraction:
        ranges = [n for chunk in chunks for n, _ in owned_ranges(config, chunk, dp_rank, tp_rank)]
        total.offloaded = sum(ranges[:offloaded_count(ranges, offload_fraction)])
    total.optimizer = (total.stepped - total.offloaded) * _device_optimizer_bytes(config)
    total.optimizer_on_host = total.offloaded * host_optimizer_bytes(config)
    return total


def stage_state_floor(config: Config, pp_rank: int, offload_fraction: float = 0.0) -> float:
    """A lower bound of stage_state_bytes(config, pp_rank, 0, offload_fraction).total from the stage's parameter
    elements alone (no bucket cut): every bucket holds at least its elements and a rank's shard of it at least
    1/group of them, so the rank keeps and steps at least its elements / group, with no optimizer state counted
    where some of it is offloaded. Under ZeRO-1 it is the exact figure less the padding."""
    stage, weight = zero_stage_of(config), param_bytes(config)
    dense = expert = 0
    for chunk in model_chunk_plans(config, pp_rank):
        chunk_dense, chunk_expert = chunk_numels(config, chunk)
        dense, expert = dense + chunk_dense, expert + chunk_expert
    whole = dense + expert
    dense_group, expert_group = group_sizes(config)
    stepped = dense / dense_group + expert / expert_group if stage.shards_optimizer_state else whole
    if config.optimizer.optimizer == "muon":  # an fp32 state per stepped element and the masters (muon_optimizer_bytes)
        optimizer = stepped * (FP32 + (0 if weight == FP32 else FP32))
    else:
        optimizer = 0 if offload_fraction else stepped * _device_optimizer_bytes(config)
    return ((stepped if stage.shards_params else whole) * weight + (stepped if stage.shards_grads else whole) * FP32
            + optimizer)


def muon_optimizer_bytes(config: Config, stepped: int, matrices: list[tuple[int, ParamShape]], chunks) -> int:
    """--optimizer muon (no offload): per stepped element the fp32 master of a bf16/fp16 weight; two fp32 Adam
    moments, or one fp32 momentum buffer for an element of a Muon matrix. Under the distributed optimizer a rank
    also holds, during the step, the whole fp32 matrices it orthogonalises (a direction and an update each):
    counted as 1/d of the stage's Muon matrices plus its largest, an estimate (owners are balanced by
    Newton-Schulz FLOPs, not bytes), and under --muon-tp-mode duplicated one matrix gathered over the ranks
    splitting it (TP; ETP for a routed expert)."""
    master = 0 if param_bytes(config) == FP32 else FP32
    in_matrices = sum(n for n, _ in matrices)
    total = stepped * master + (stepped - in_matrices) * 2 * FP32 + in_matrices * FP32
    if not zero_stage_of(config).shards_optimizer_state:
        return total
    groups = group_sizes(config)
    splits = (config.parallel.tensor_model_parallel_size, expert_tensor_parallel_size(config))
    whole = [(param.numel, groups[param.expert], splits[param.expert]) for chunk in chunks
             for param in chunk_params(config, chunk) if param.muon]
    if not whole:
        return total
    largest = max(numel for numel, _, _ in whole)
    held = sum(-(-numel // group) for numel, group, _ in whole) + largest
    duplicated = config.optimizer.muon_tp_mode == "duplicated"
    gathered = max((numel * split for numel, _, split in whole if split > 1), default=0) if duplicated else 0
    return total + (2 * held + gathered) * FP32
