"""Layouts of a model on a cluster: enumerate the valid ones, predict each one's memory and step time.

A layout is a set of Megatron flags: TP with sequence parallelism, CP, PP, virtual stages, EP and the
expert-tensor-parallel size (MoE parallel folding), the ZeRO stage and its number of distributed-optimizer
instances, recomputation, --pipeline-schedule and --optimizer-cpu-offload with --optimizer-offload-fraction; a
configuration's schedule and offloaded share are read from those flags. Validity is decided by config/validation.py,
through arguments.make_config, exactly as a launch with those flags would decide it; a layout is then planned
per pipeline stage (stages differ: the first holds the embedding and the most micro-batches in flight, the last
the output layer and the loss).

An enumeration can meet tens of thousands of layouts (DeepSeek-V3 on 1,024 GPUs: 90,360). Its layouts share chunks
and the model, so what depends on those alone is computed once (shared_cache.py); and a layout whose parameters,
gradients and optimizer state alone exceed the GPU's memory cannot fit whatever its activations, so unless every
layout is asked for it is counted and not planned further (a lower bound without the bucket cut first,
state_memory.stage_state_floor, then the exact bytes), nor are the candidates that differ from it only in
recomputation or pipeline schedule, which hold the same state, validated.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from megatron_lite.config.arguments import make_config, with_preset
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.errors import ConfigError
from megatron_lite.optim.zero_stage import ZeroStage
from megatron_lite.planning.activation_memory import ActivationBytes, stage_activation_bytes
from megatron_lite.planning.shared_cache import shared_results
from megatron_lite.planning.state_memory import StateBytes, stage_state_bytes, stage_state_floor
from megatron_lite.planning.step_time import (
    DataParallelBytes,
    Hardware,
    StepTime,
    data_parallel_bytes,
    predict_step_time,
)

STRATEGIES = tuple(stage.value for stage in ZeroStage)
RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


@dataclass
class StagePlan:
    """One pipeline stage: the bytes each of its ranks holds."""

    pp_rank: int
    first_rank: int  # its lowest global rank (rank order tp, cp, dp, pp)
    state: StateBytes
    activations: ActivationBytes

    @property
    def total(self) -> int:
        return self.state.total + self.activations.peak


@dataclass
class Plan:
    """A layout's predicted per-stage memory and step time on a cluster with `memory_bytes` per GPU."""

    config: Config
    schedule: str
    offload_fraction: float
    stages: list[StagePlan]
    step_time: StepTime
    data_parallel_bytes: DataParallelBytes  # what the busiest rank sends per step, within and across nodes
    memory_bytes: int
    flags: dict = field(default_factory=dict)

    @property
    def largest(self) -> StagePlan:
        return max(self.stages, key=lambda stage: stage.total)

    @property
    def fits(self) -> bool:
        return self.largest.total <= self.memory_bytes

    @property
    def over_by(self) -> int:
        """Bytes by which the fullest rank exceeds the GPU's memory (0 when it fits)."""
        return max(self.largest.total - self.memory_bytes, 0)


def schedule_of(config: Config) -> str:
    """The schedule training.get_schedule runs for this layout."""
    if config.parallel.pipeline_model_parallel_size == 1:
        return "no_pipelining"
    if config.virtual_pipeline_stages is not None:
        return "interleaved"
    return config.parallel.pipeline_schedule


def offload_fraction_of(config: Config) -> float:
    """The share of the optimizer state held on the host (--optimizer-cpu-offload, --optimizer-offload-fraction)."""
    o = config.optimizer
    return o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0


def stage_states(config: Config) -> list[StateBytes]:
    """Parameters, gradients and optimizer state of the fullest rank (index 0 of its groups) of every stage."""
    fraction = offload_fraction_of(config)
    return [stage_state_bytes(config, stage, 0, fraction)
            for stage in range(config.parallel.pipeline_model_parallel_size)]


def plan_layout(config: Config, memory_bytes: int, hardware: Hardware, flags: dict | None = None,
                states: list[StateBytes] | None = None) -> Plan:
    """Memory per stage and step time of a validated configuration (`states`: its stage_states, if known)."""
    schedule, offload_fraction = schedule_of(config), offload_fraction_of(config)
    p = config.parallel
    ranks_per_stage = p.tensor_model_parallel_size * p.context_parallel_size * p.data_parallel_size
    stages = [StagePlan(stage, stage * ranks_per_stage, state, stage_activation_bytes(config, stage, schedule))
              for stage, state in enumerate(states or stage_states(config))]
    busiest = max(stages, key=lambda stage: stage.state.numel).state
    return Plan(config, schedule, offload_fraction, stages, predict_step_time(config, schedule, busiest, hardware),
                data_parallel_bytes(config, busiest, hardware), memory_bytes, flags or {})


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def pipeline_split(num_layers: int, pp: int, vp: int) -> dict | None:
    """The split flags of `num_layers` over pp stages of vp chunks each: none where they divide evenly; else,
    without virtual stages, Megatron's --decoder-first/last-pipeline-num-layers with every middle stage holding
    ceil(num_layers / pp) layers and the rest split between the first stage and the last (which also holds the
    output layer), the first taking the larger half; None where no such split exists."""
    if num_layers % (pp * vp) == 0:
        return {}
    per_stage = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * per_stage
    if vp > 1 or pp < 2 or rest < 2:
        return None
    return {"decoder_first_pipeline_num_layers": rest - rest // 2, "decoder_last_pipeline_num_layers": rest // 2}


def _expert_tensor_sizes(model: dict, tp: int, stage: int, ep: int, gpus_per_node: int) -> list[int]:
    """Expert-tensor-parallel sizes to try with TP `tp` and EP `ep` on stages of `stage` ranks: TP itself, and
    for an MoE model each size within a node that divides stage / ep and --moe-ffn-hidden-size."""
    if not model.get("num_experts"):
        return [tp]
    hidden = model.get("hidden_size", ModelConfig.hidden_size)
    ffn = model.get("moe_ffn_hidden_size") or model.get("ffn_hidden_size") or 4 * hidden
    return [etp for etp in _divisors(stage // ep, gpus_per_node) if ffn % etp == 0 or etp == tp]


def candidate_flags(base: dict, world_size: int, gpus_per_node: int, schedules: tuple[str, ...],
                    offload_fractions: tuple[float, ...] = (0.0,), strategies=STRATEGIES, recompute=tuple(RECOMPUTE)):
    """Layout flags to try: TP within a node (with sequence parallelism), CP, PP with 1, 2 or 4 virtual stages
    (each of `schedules` without virtual stages; a layer count that does not divide evenly split by
    `pipeline_split`), EP for MoE models (their --model-preset's too) and for each an expert-tensor-parallel size
    within a node (`_expert_tensor_sizes`; named only where it differs from TP), every ZeRO stage (the sharded
    ones with every number of distributed-optimizer instances dividing dp x cp and the expert data-parallel
    size, which folding leaves at one instance) and recomputation choice, and each share of the optimizer state
    offloaded to the host (0: none)."""
    model = with_preset(base)
    experts = model.get("num_experts") or 0
    num_layers = model.get("num_layers", ModelConfig.num_layers)
    for tp, cp, pp in itertools.product(_divisors(world_size, gpus_per_node), _divisors(world_size),
                                        _divisors(world_size)):
        if world_size % (tp * cp * pp) or pp > num_layers:
            continue
        dp_cp = world_size // (tp * pp)
        for ep in [ep for ep in _divisors(dp_cp) if experts and experts % ep == 0] or [1]:
            for etp in _expert_tensor_sizes(model, tp, tp * dp_cp, ep, gpus_per_node):
                instances = _divisors(math.gcd(dp_cp, tp * dp_cp // (etp * ep))) if etp == tp else [1]
                sharding = [(strategy, count) for strategy in strategies
                            for count in (instances if strategy != "no_shard" else [1])]
                yield from _layout_flags(tp, cp, pp, ep, etp, sharding, num_layers, schedules, offload_fractions,
                                         recompute)


def _layout_flags(tp, cp, pp, ep, etp, sharding, num_layers, schedules, offload_fractions, recompute):
    """candidate_flags for one choice of the model-parallel sizes."""
    for vp, (strategy, instances), recompute_name, fraction in itertools.product(
            (1, 2, 4) if pp > 1 else (1,), sharding, recompute, offload_fractions):
        flags = {"tensor_model_parallel_size": tp, "sequence_parallel": tp > 1, "context_parallel_size": cp,
                 "pipeline_model_parallel_size": pp, "data_parallel_sharding_strategy": strategy,
                 **RECOMPUTE[recompute_name]}
        if ep > 1:  # named only where it acts, as every flag
            flags["expert_model_parallel_size"] = ep
        if etp != tp:
            flags["expert_tensor_parallel_size"] = etp
        if instances > 1:
            flags["num_distributed_optimizer_instances"] = instances
        if vp > 1:
            flags["num_virtual_stages_per_pipeline_rank"] = vp
        split = pipeline_split(num_layers, pp, vp)
        if split is None:
            continue
        flags.update(split)
        if fraction:
            flags.update(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)
        if pp == 1 or vp > 1:
            yield flags
            continue
        for schedule in schedules:
            yield {**flags, "pipeline_schedule": schedule}


def _state_cannot_fit(config: Config, memory_bytes: int) -> bool:
    """Whether some stage's parameters, gradients and optimizer state exceed the memory by their lower bound alone
    (stage_state_floor, which needs no bucket cut)."""
    fraction = offload_fraction_of(config)
    return any(stage_state_floor(config, stage, fraction) > memory_bytes
               for stage in range(config.parallel.pipeline_model_parallel_size))


@dataclass
class Enumeration:
    """What `enumerate_plans` found."""

    plans: list[Plan]  # the planned layouts, fastest first
    refused: Counter  # candidates validation refused, by its message
    over_in_state: int  # candidates not planned: their parameters, gradients and optimizer state exceed memory


# Flags that leave parameters, gradients and optimizer state as they are.
_NOT_IN_STATE = frozenset({"pipeline_schedule", *(flag for flags in RECOMPUTE.values() for flag in flags)})


def enumerate_plans(base: dict, world_size: int, memory_bytes: int, hardware: Hardware,
                    schedules: tuple[str, ...] = ("1f1b",), offload_fractions: tuple[float, ...] = (0.0,),
                    every_layout: bool = False) -> Enumeration:
    """Every valid layout's plan, fastest first. Unless `every_layout`, a layout whose parameters, gradients and
    optimizer state alone exceed `memory_bytes` is counted, not planned, and so is every candidate that differs
    from it only in recomputation or pipeline schedule, without validating it (its state is the same)."""
    plans, refused, over = [], Counter(), 0
    cannot_fit: set[tuple] = set()  # candidates' state-deciding flags known to exceed the memory
    with shared_results():
        for flags in candidate_flags(base, world_size, hardware.gpus_per_node, schedules, offload_fractions):
            state_flags = tuple(sorted(item for item in flags.items() if item[0] not in _NOT_IN_STATE))
            if state_flags in cannot_fit:
                over += 1
                continue
            try:
                config = make_config({**base, **flags}, world_size)
            except ConfigError as error:
                refused[str(error)] += 1
                continue
            states = None if not every_layout and _state_cannot_fit(config, memory_bytes) else stage_states(config)
            if not every_layout and (states is None or max(state.total for state in states) > memory_bytes):
                cannot_fit.add(state_flags)
                over += 1
                continue
            plans.append(plan_layout(config, memory_bytes, hardware, flags, states))
    plans.sort(key=lambda plan: plan.step_time.total)
    return Enumeration(plans, refused, over)
