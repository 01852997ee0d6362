"""A roofline step time: GEMM FLOPs at a sustained rate, collective bytes over link bandwidths, the bubble.

Nothing overlaps in this model (an upper bound where --overlap-grad-reduce / --overlap-param-gather
hide communication). Per rank and step, with m micro-batches of t local tokens:

  compute     model FLOPs (logging.training_flops_per_token, matrix multiplies) of the rank's share of the
              global batch, plus the forward again for fully recomputed layers, at `tflops`
  bubble      compute x (P - 1) / m for 1F1B and GPipe, (P - 1) / (v m) interleaved, a third of 1F1B's for
              ZB-H1 (its weight-gradient passes fill two thirds of the idle time)
  tensor par. 4 all-reduces (or all-gather + reduce-scatter with SP, the same bytes) of t h e per layer and
              micro-batch, 2 (tp - 1) / tp of them over the link (6 with full recomputation)
  context     K/V around the ring: 3 (cp - 1) steps of the rank's K and V per layer and micro-batch
  pipeline    one t h e send per micro-batch, chunk and direction
  data par.   fp32 gradients all-reduced (no_shard) or reduce-scattered (once, ZeRO-1; every micro-batch,
              ZeRO-2/3) and parameters all-gathered (once, ZeRO-1/2; forward and backward of every
              micro-batch, ZeRO-3), (d - 1) / d of the bytes each; with N distributed-optimizer instances
              these within an instance (d / N ranks), and the rank's fp32 gradient shard all-reduced across
              the instances once per step, 2 (N - 1) / N of its bytes (`data_parallel_bytes`)
  experts     4 all-to-alls of the t k routed tokens per MoE layer and micro-batch, (ep - 1) / ep of them
  offload     the optimizer state moved to the host costs its gradients down and parameters up per step
              over `host_bandwidth`

A group whose ranks all fit in one node (rank order tp, cp, dp, pp) uses `intra_node_bandwidth`, else
`inter_node_bandwidth` (bytes/s, one direction, per GPU). An instance is d / N consecutive data-parallel
ranks, tp d / N ranks of the rank order; the inter-instance group spans all tp d of them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_lite.config import Config
from megatron_lite.logging import training_flops_per_token
from megatron_lite.model.moe import moe_layer_numbers
from megatron_lite.planning.state_memory import FP32, StateBytes, param_bytes, zero_stage_of


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
    """What a rank holding `state` sends per step to reduce gradients and gather parameters."""
    p = config.parallel
    tp, d = p.tensor_model_parallel_size, p.data_parallel_size * p.context_parallel_size
    instances = p.num_distributed_optimizer_instances
    traffic = DataParallelBytes()
    stage, e, micro = zero_stage_of(config), param_bytes(config), config.num_microbatches
    if not stage.shards_optimizer_state:
        traffic.add(2 * (d - 1) / d * state.numel * FP32, tp * d, hardware)
        return traffic
    s = d // instances  # ranks of one instance
    reductions = micro if stage.shards_grads else 1
    gathers = 2 * micro if stage.shards_params else 1
    traffic.add((s - 1) / s * state.numel * (reductions * FP32 + gathers * e), tp * s, hardware)
    traffic.add(2 * (instances - 1) / instances * state.numel / s * FP32, tp * d, hardware)
    return traffic


def predict_step_time(config: Config, schedule: str, state: StateBytes, hardware: Hardware) -> StepTime:
    """The roofline of one step for a rank of the busiest stage (`state`: its parameters and gradients)."""
    m, p, t = config.model, config.parallel, config.training
    tp, cp, pp, dp, ep = (p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                          p.data_parallel_size, p.expert_model_parallel_size)
    e = param_bytes(config)
    micro, v = config.num_microbatches, config.virtual_pipeline_stages or 1
    tokens = m.seq_length // cp * t.micro_batch_size
    layers = m.num_layers // pp
    flops = training_flops_per_token(m) * m.seq_length * t.global_batch_size / (tp * cp * pp * dp)
    if m.recompute_granularity == "full":
        flops *= 1 + 1 / 3  # the forward of every layer again (head and embedding are a small share)
    compute = flops / (hardware.tflops * 1e12)
    bubble_share = (pp - 1) / (micro * (v if schedule == "interleaved" else 1)) if pp > 1 else 0.0
    if schedule == "zb-h1":
        bubble_share /= 3
    tp_collectives = 6 if m.recompute_granularity == "full" else 4
    tensor_parallel = (layers * micro * tp_collectives * tokens * m.hidden_size * e * 2 * (tp - 1) / tp
                       / _bandwidth(hardware, tp)) if tp > 1 else 0.0
    kv_bytes = tokens * 2 * (m.num_query_groups // tp) * m.head_dim * e
    context_parallel = (layers * micro * 3 * (cp - 1) * kv_bytes / _bandwidth(hardware, tp * cp)) if cp > 1 else 0.0
    stream = tokens // tp if p.sequence_parallel else tokens
    pipeline = (2 * micro * v * stream * m.hidden_size * e / _bandwidth(hardware, tp * cp * dp + 1)) if pp > 1 else 0.0
    data_parallel = data_parallel_bytes(config, state, hardware).seconds(hardware)
    expert_parallel = 0.0
    if ep > 1:
        moe_here = len(moe_layer_numbers(m)) / pp
        routed = tokens * m.moe_router_topk * m.hidden_size * e
        expert_parallel = moe_here * micro * 4 * routed * (ep - 1) / ep / _bandwidth(hardware, tp * ep)
    offload = 0.0
    if state.offloaded:
        offload = state.offloaded * (FP32 + e) / hardware.host_bandwidth
    return StepTime(compute, compute * bubble_share, tensor_parallel, context_parallel, pipeline, data_parallel,
                    expert_parallel, offload)
