"""The planner's output: a table of layouts, one layout's per-stage memory, JSON, and the start-up report."""

from __future__ import annotations

from dataclasses import asdict

from megatron_lite.config.sections import Config
from megatron_lite.model.kinds.activation_terms import expert_tensor_parallel_size
from megatron_lite.planning.layouts import Plan, plan_layout
from megatron_lite.planning.state_memory import zero_stage_of
from megatron_lite.planning.step_time import Hardware

GIB = 2**30


def layout_name(plan: Plan) -> str:
    """tp2 cp1 pp4 vp2 dp8 ep1 ZeRO-1 instances=2 recompute=full 1f1b offload=0.5, in Megatron's terms (instances:
    --num-distributed-optimizer-instances, when above 1; etpN after epN: --expert-tensor-parallel-size, where it
    differs from TP)."""
    c = plan.config
    p, m = c.parallel, c.model
    stage = zero_stage_of(c)
    level = stage.shards_optimizer_state + stage.shards_grads + stage.shards_params
    parts = [f"tp{p.tensor_model_parallel_size}{'+sp' if p.sequence_parallel else ''}",
             f"cp{p.context_parallel_size}", f"pp{p.pipeline_model_parallel_size}",
             f"vp{c.virtual_pipeline_stages or 1}", f"dp{p.data_parallel_size}"]
    if m.num_experts:
        parts.append(f"ep{p.expert_model_parallel_size}")
        etp = expert_tensor_parallel_size(c)
        if etp != p.tensor_model_parallel_size:
            parts.append(f"etp{etp}")
    parts.append(f"ZeRO-{level}" if level else "no-ZeRO")
    if p.num_distributed_optimizer_instances > 1:
        parts.append(f"instances={p.num_distributed_optimizer_instances}")
    parts += [f"recompute={m.recompute_granularity or 'none'}", plan.schedule]
    if plan.offload_fraction:
        parts.append(f"offload={plan.offload_fraction:g}")
    return " ".join(parts)


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def stage_lines(plan: Plan) -> list[str]:
    """One line per pipeline stage: the bytes of each of its ranks, in GiB."""
    lines = [f"  {'stage':>5} {'ranks':>11} {'params':>7} {'grads':>7} {'optim':>7} {'act/mb':>7} {'in-flt':>6} "
             f"{'act pk':>7} {'total':>7}" + ("  host optim" if plan.offload_fraction else "")]
    p = plan.config.parallel
    per_stage = p.tensor_model_parallel_size * p.context_parallel_size * p.data_parallel_size
    for stage in plan.stages:
        s, a = stage.state, stage.activations
        ranks = f"{stage.first_rank}-{stage.first_rank + per_stage - 1}"
        line = (f"  {stage.pp_rank:>5} {ranks:>11} {_gib(s.params)} {_gib(s.grads)} {_gib(s.optimizer)} "
                f"{_gib(a.per_microbatch)} {a.in_flight:>6.2f} {_gib(a.peak)} {_gib(stage.total)}")
        if plan.offload_fraction:
            line += f"  {_gib(s.optimizer_on_host)}"
        lines.append(line)
    return lines


def table_lines(plans: list[Plan], top: int | None) -> list[str]:
    """The layouts fastest first, with the fullest rank's GiB and whether it fits."""
    lines = [f"{'#':>3} {'step s':>8} {'max GiB':>8} {'fits':>5}  layout"]
    for index, plan in enumerate(plans[:top] if top else plans, 1):
        fits = "yes" if plan.fits else f"+{plan.over_by / GIB:.1f}"
        lines.append(f"{index:>3} {plan.step_time.total:>8.3f} {plan.largest.total / GIB:>8.2f} {fits:>5}  "
                     f"{layout_name(plan)}")
    return lines


def plan_lines(plan: Plan) -> list[str]:
    """One layout in full: per-stage memory and the step-time components."""
    t = plan.step_time
    return [layout_name(plan), *stage_lines(plan),
            f"  step {t.total:.3f} s = compute {t.compute:.3f} + bubble {t.bubble:.3f} + tp {t.tensor_parallel:.3f}"
            f" + cp {t.context_parallel:.3f} + pp {t.pipeline:.3f} + dp {t.data_parallel:.3f}"
            f" + ep {t.expert_parallel:.3f} + offload {t.offload:.3f}",
            f"  data parallel per step and rank: {plan.data_parallel_bytes.intra_node / GIB:.2f} GiB within nodes, "
            f"{plan.data_parallel_bytes.inter_node / GIB:.2f} GiB across nodes"]


def refusal(plan: Plan) -> str:
    """Why a layout cannot run: the fullest rank and the bytes by which it is over, with what to change."""
    stage = plan.largest
    return (f"layout {layout_name(plan)} does not fit: rank {stage.first_rank} (pipeline stage {stage.pp_rank}) "
            f"needs {stage.total:,} bytes ({stage.total / GIB:.2f} GiB) of {plan.memory_bytes:,} "
            f"({plan.memory_bytes / GIB:.2f} GiB), over by {plan.over_by:,} bytes ({plan.over_by / GIB:.2f} GiB); "
            f"shard more (ZeRO stage, TP, PP), recompute activations or use a smaller micro-batch")


def plan_record(plan: Plan) -> dict:
    """A layout as JSON-ready values (bytes as integers)."""
    return {"layout": layout_name(plan), "flags": plan.flags, "schedule": plan.schedule,
            "offload_fraction": plan.offload_fraction, "fits": plan.fits, "over_by_bytes": plan.over_by,
            "max_rank_bytes": plan.largest.total, "step_time_s": plan.step_time.total,
            "step_time": asdict(plan.step_time),
            "data_parallel_bytes": {"intra_node": plan.data_parallel_bytes.intra_node,
                                    "inter_node": plan.data_parallel_bytes.inter_node},
            "stages": [{"pp_rank": s.pp_rank, "first_rank": s.first_rank, "params_bytes": s.state.params,
                        "grads_bytes": s.state.grads, "optimizer_bytes": s.state.optimizer,
                        "optimizer_host_bytes": s.state.optimizer_on_host,
                        "activation_bytes_per_microbatch": s.activations.per_microbatch,
                        "microbatches_in_flight": s.activations.in_flight,
                        "activation_peak_bytes": s.activations.peak, "total_bytes": s.total}
                       for s in plan.stages]}


def theoretical_memory_report(config: Config) -> str:
    """The start-up block, as Megatron's theoretical memory report: what each rank of each pipeline stage
    should hold for this run's layout (pretrain_gpt.py prints it on rank 0)."""
    plan = plan_layout(config, memory_bytes=0, hardware=Hardware())
    return "\n".join([f"theoretical memory per rank, GiB ({layout_name(plan)}; act/mb: activations of one "
                      f"micro-batch, act pk: at the schedule's peak; see tools/plan_layout.py):", *stage_lines(plan)])
