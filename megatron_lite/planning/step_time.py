"""A roofline step time: GEMM FLOPs at a sustained rate, collective bytes over link bandwidths, the bubble.

Nothing overlaps in this model (an upper bound where --overlap-grad-reduce / --overlap-param-gather
hide communication). Per rank and step, with m micro-batches of t local tokens:

  compute     model FLOPs (model/flops.py, matrix multiplies) of the rank's share of the
              global batch, plus the forward again for fully recomputed layers, at `tflops`
  bubble      compute x (P - 1) / m for 1F1B and GPipe, (P - 1) / (v m) interleaved, a third of 1F1B's for
              ZB-H1 (its weight-gradient passes fill two thirds of the idle time)
  tensor par. 4 all-reduces (or all-gather + reduce-scatter with SP, the same bytes) of t h e per layer and
              micro-batch, 2 (tp - 1) / tp of them over the link (6 with full recomputation): half in
              attention, half in the MLP; a folded MoE layer (ETP != TP) makes its MLP half over the ETP
              group on the expert region's tokens (model/kinds/activation_terms.expert_region_tokens) and, with
              a shared expert, the dense MLP's half again over TP
  context     K/V around the ring: 3 (cp - 1) steps of the rank's K and V per layer and micro-batch
  pipeline    one t h e send per micro-batch, chunk and direction
  data par.   fp32 gradients all-reduced (no_shard) or reduce-scattered (once, ZeRO-1; every micro-batch,
              ZeRO-2/3) and parameters all-gathered (once, ZeRO-1/2; forward and backward of every
              micro-batch, ZeRO-3), (d - 1) / d of the bytes each, d = dp x cp for dense parameters and the
              expert data-parallel size edp = tp cp dp / (etp ep) for routed experts'; with N
              distributed-optimizer instances these within an instance (d / N ranks), and the rank's fp32
              gradient shard all-reduced across the instances once per step, 2 (N - 1) / N of its bytes
              (`data_parallel_bytes`)
  experts     4 all-to-alls of the expert region's k copies of its tokens per MoE layer and micro-batch,
              (ep - 1) / ep of them, over the EP group (ranks etp apart)
  offload     the optimizer state moved to the host costs its gradients down and parameters up per step
              over `host_bandwidth`

A group whose ranks all fit in one node (rank order tp, cp, dp, pp; etp, ep, edp within a stage) uses
`intra_node_bandwidth`, else `inter_node_bandwidth` (bytes/s, one direction, per GPU). An instance is d / N
consecutive data-parallel ranks, tp d / N ranks of the rank order; the inter-instance group spans all tp d of
them. An expert data-parallel group spans the whole stage, an instance of it etp ep edp / N ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_lite.config.layer_specs import layer_specs
from megatron_lite.config.sections import Config
from megatron_lite.model.flops import training_flops_per_token
from megatron_lite.model.kinds.activation_terms import (
    FP32,
    expert_region_tokens,
    expert_tensor_parallel_size,
    param_bytes,
)
from megatron_lite.planning.shared_cache import shared
from megatron_lite.planning.state_memory import StateBytes, zero_stage_of


@dataclass(frozen=True)
class Hardware:
    """What the roofline assumes of the machine."""

    tflops: float = 400.0  # sustained dense bf16 GEMM rate per GPU (H100 SXM: ~400 of its 989 peak)
    intra_node_bandwidth: float = 200e9  # bytes/s per GPU within a node (NVLink)
    inter_node_bandwidth: float = 25e9  # bytes/s per GPU across nodes (one 200 Gb/s NIC per GPU)
    host_bandwidth: float = 25e9  # bytes/s between a GPU and host memory (PCIe 5 x16, one direction)
    gpus_per_node: int = 8


@dataclass
class StepTime:
    """Predicted seconds of one training step, by component."""

    compute: float
    bubble: float
    tensor_parallel: float
    context_parallel: float
    pipeline: float
    data_parallel: float
    expert_parallel: float
    offload: float

    @property
    def total(self) -> float:
        return sum(asdict(self).values())


def _bandwidth(hardware: Hardware, span: int) -> float:
    """The link a group of ranks `span` apart in rank order crosses."""
    return hardware.intra_node_bandwidth if span <= hardware.gpus_per_node else hardware.inter_node_bandwidth


@dataclass
class DataParallelBytes:
    """Bytes one rank sends per step for data parallelism, by the link they cross."""

    intra_node: float = 0.0
    inter_node: float = 0.0

    def add(self, nbytes: float, span: int, hardware: Hardware) -> None:
        """A collective over a group whose ranks span `span` consecutive ranks."""
        if span <= hardware.gpus_per_node:
            self.intra_node += nbytes
        else:
            self.inter_node += nbytes

    def seconds(self, hardware: Hardware) -> float:
        return self.intra_node / hardware.intra_node_bandwidth + self.inter_node / hardware.inter_node_bandwidth


def data_parallel_bytes(config: Config, state: StateBytes, hardware: Hardware) -> DataParallelBytes:
    """What a rank holding `state` sends per step to reduce gradients and gather parameters: its dense parameters
    over dp x cp, its routed experts' over the expert data-parallel ranks."""
    p = config.parallel
    tp, d = p.tensor_model_parallel_size, p.data_parallel_size * p.context_parallel_size
    edp = tp * d // (expert_tensor_parallel_size(config) * p.expert_model_parallel_size)
    instances = p.num_distributed_optimizer_instances
    traffic = DataParallelBytes()
    stage, e, micro = zero_stage_of(config), param_bytes(config), config.num_microbatches
    # (elements, ranks of the group, ranks of the rank order one instance of it spans)
    kinds = [(state.numel - state.expert_numel, d, tp * d // instances), (state.expert_numel, edp, tp * d // instances)]
    for numel, ranks, span in kinds:
        if not numel or ranks == 1:
            continue
        if not stage.shards_optimizer_state:
            traffic.add(2 * (ranks - 1) / ranks * numel * FP32, tp * d, hardware)
            continue
        s = ranks // instances  # ranks of one instance
        reductions = micro if stage.shards_grads else 1
        gathers = 2 * micro if stage.shards_params else 1
        traffic.add((s - 1) / s * numel * (reductions * FP32 + gathers * e), span, hardware)
        traffic.add(2 * (instances - 1) / instances * numel / s * FP32, tp * d, hardware)
    return traffic


def _all_reduce_seconds(tokens: int, ranks: int, config: Config, hardware: Hardware) -> float:
    """One all-reduce of [tokens, h] (or its all-gather + reduce-scatter halves) over `ranks` adjacent ranks."""
    if ranks == 1:
        return 0.0
    size = tokens * config.model.hidden_size * param_bytes(config)
    return size * 2 * (ranks - 1) / ranks / _bandwidth(hardware, ranks)


def _tensor_parallel_seconds(config: Config, hardware: Hardware, tokens: int) -> float:
    """The TP (and ETP) collectives of one micro-batch through a stage's layers (module docstring)."""
    m, p = config.model, config.parallel
    tp, pp, etp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, expert_tensor_parallel_size(config)
    layers = m.num_layers // pp
    per_branch = 3 if m.recompute_granularity == "full" else 2  # forward, backward (and the recomputed forward)
    dense = _all_reduce_seconds(tokens, tp, config, hardware)
    seconds = 2 * layers * dense  # attention and MLP
    if etp != tp and m.num_experts:
        moe_here = sum(spec.routed_experts for spec in layer_specs(m)) / pp
        experts = _all_reduce_seconds(expert_region_tokens(config), etp, config, hardware)
        shared = dense if m.moe_shared_expert_intermediate_size else 0.0
        seconds += moe_here * (experts + shared - dense)
    return per_branch * seconds


def predict_step_time(config: Config, schedule: str, state: StateBytes, hardware: Hardware) -> StepTime:
    """The roofline of one step for a rank of the busiest stage (`state`: its parameters and gradients)."""
    m, p, t = config.model, config.parallel, config.training
    tp, cp, pp, dp, ep = (p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                          p.data_parallel_size, p.expert_model_parallel_size)
    e = param_bytes(config)
    micro, v = config.num_microbatches, config.virtual_pipeline_stages or 1
    tokens = m.seq_length // cp * t.micro_batch_size
    layers = m.num_layers // pp
    per_token = shared(("training flops per token", repr(m)), lambda: training_flops_per_token(m))
    flops = per_token * m.seq_length * t.global_batch_size / (tp * cp * pp * dp)
    if m.recompute_granularity == "full":
        flops *= 1 + 1 / 3  # the forward of every layer again (head and embedding are a small share)
    compute = flops / (hardware.tflops * 1e12)
    bubble_share = (pp - 1) / (micro * (v if schedule == "interleaved" else 1)) if pp > 1 else 0.0
    if schedule == "zb-h1":
        bubble_share /= 3
    tensor_parallel = micro * _tensor_parallel_seconds(config, hardware, tokens)
    kv_bytes = tokens * 2 * (m.num_query_groups // tp) * m.head_dim * e
    context_parallel = (layers * micro * 3 * (cp - 1) * kv_bytes / _bandwidth(hardware, tp * cp)) if cp > 1 else 0.0
    stream = tokens // tp if p.sequence_parallel else tokens
    pipeline = (2 * micro * v * stream * m.hidden_size * e / _bandwidth(hardware, tp * cp * dp + 1)) if pp > 1 else 0.0
    data_parallel = data_parallel_bytes(config, state, hardware).seconds(hardware)
    expert_parallel = 0.0
    if ep > 1:
        moe_here = sum(spec.routed_experts for spec in layer_specs(m)) / pp
        routed = expert_region_tokens(config) * m.moe_router_topk * m.hidden_size * e
        span = expert_tensor_parallel_size(config) * ep
        expert_parallel = moe_here * micro * 4 * routed * (ep - 1) / ep / _bandwidth(hardware, span)
    offload = 0.0
    if state.offloaded:
        offload = state.offloaded * (FP32 + e) / hardware.host_bandwidth
    return StepTime(compute, compute * bubble_share, tensor_parallel, context_parallel, pipeline, data_parallel,
                    expert_parallel, offload)
