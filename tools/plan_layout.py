"""Which layouts of a model fit a cluster, and which is fastest: per-rank memory and a roofline step time.

    python tools/plan_layout.py --model-preset llama3-8b --world-size 8 --global-batch-size 64
    python tools/plan_layout.py --model-preset llama3-8b --world-size 64 --global-batch-size 512 --json
    python tools/plan_layout.py --model-preset llama3-8b --world-size 8 --global-batch-size 64 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --use-distributed-optimizer

Model and training flags are pretrain_gpt.py's (a --model-preset, --seq-length, --micro-batch-size, --bf16, ...).
Without layout flags every valid layout is planned (config/validation.py decides validity) and listed by predicted
step time, those that do not fit marked with the GiB they are over (--pipeline-schedule, when given, is the one
schedule tried for pipelined layouts without virtual stages, the others keeping no pipelining or interleaved
1F1B; --optimizer-cpu-offload with --optimizer-offload-fraction holds for every layout; when validation refuses
every layout its message is printed and the exit status is 2); with layout flags
(--tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
--expert-model-parallel-size, --expert-tensor-parallel-size, a virtual-stage flag, a ZeRO or recomputation flag)
that one layout is planned per pipeline stage, and refused (exit status 1) when a rank
would not fit, naming the rank and the bytes by which it is over. When enumerating, a layout whose parameters,
gradients and optimizer state alone exceed --gpu-memory-gib is counted but not planned further (its activations
and step time are not computed, it is not listed, and the candidates differing from it only in recomputation or
schedule are not validated) unless --all-layouts is given. How each figure is predicted: megatron_lite/planning/.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.config.arguments import build_parser, make_config  # noqa: E402
from megatron_lite.errors import UserError  # noqa: E402
from megatron_lite.tool_args import ToolParser, fraction, non_negative_int, positive_float, positive_int  # noqa: E402

if TYPE_CHECKING:
    from megatron_lite.planning.step_time import Hardware

LAYOUT_FLAGS = {"tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "num_layers_per_virtual_pipeline_stage",
                "num_virtual_stages_per_pipeline_rank", "use_distributed_optimizer", "data_parallel_sharding_strategy",
                "num_distributed_optimizer_instances", "recompute_granularity"}
SEARCH_LIMIT = 1024  # when no layout fits, world sizes up to this many times --world-size are tried


def planner_parser() -> ToolParser:
    parser = ToolParser(prog="plan_layout.py", description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--world-size", type=positive_int, help="GPUs (ranks) in the job (required)")
    parser.add_argument("--gpu-memory-gib", type=positive_float, default=80.0, help="memory per GPU (default 80)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8)
    parser.add_argument("--tflops", type=positive_float, default=400.0,
                        help="sustained GEMM TFLOP/s per GPU (default 400)")
    parser.add_argument("--intra-node-gbps", type=positive_float, default=200.0, help="GB/s per GPU within a node")
    parser.add_argument("--inter-node-gbps", type=positive_float, default=25.0, help="GB/s per GPU across nodes")
    parser.add_argument("--host-gbps", type=positive_float, default=25.0, help="GB/s between a GPU and host memory")
    parser.add_argument("--schedules", nargs="+", default=["1f1b"], choices=["1f1b", "gpipe", "zb-h1"],
                        help="non-interleaved pipeline schedules to consider when enumerating (virtual stages are "
                             "interleaved 1F1B); --pipeline-schedule plans that one only")
    parser.add_argument("--offload-fractions", nargs="+", type=fraction, default=[0.0],
                        help="shares of the optimizer state held in host memory to consider when enumerating (0 to "
                             "1); --optimizer-cpu-offload with --optimizer-offload-fraction plans that one only")
    parser.add_argument("--top", type=non_negative_int, default=20, help="layouts to list (default 20; 0: all)")
    parser.add_argument("--all-layouts", action="store_true",
                        help="also plan and list the layouts whose parameters, gradients and optimizer state alone "
                             "exceed --gpu-memory-gib (slower; by default they are only counted)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    planner = planner_parser()
    args, rest = planner.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        planner.print_help()
        print("\nand pretrain_gpt.py's model and training flags (pretrain_gpt.py --help)")
        return 0
    if args.world_size is None:
        planner.error("the following arguments are required: --world-size")
    flags = vars(ToolParser(prog="plan_layout.py", parents=[build_parser()], add_help=False,
                            argument_default=argparse.SUPPRESS).parse_args(rest))
    if "config" in flags:
        planner.error("pass flags, not --config")
    values = {"mock_data": True, **flags}
    from megatron_lite.planning import report  # the planner imports torch: only once the flags are read
    from megatron_lite.planning.layouts import enumerate_plans
    from megatron_lite.planning.step_time import Hardware

    hardware = Hardware(args.tflops, args.intra_node_gbps * 1e9, args.inter_node_gbps * 1e9, args.host_gbps * 1e9,
                        args.gpus_per_node)
    memory = int(args.gpu_memory_gib * report.GIB)
    try:
        if LAYOUT_FLAGS & flags.keys():
            return _check_one(values, args, memory, hardware)
        schedules = tuple(args.schedules)
        if "pipeline_schedule" in flags:  # candidates without a non-interleaved pipeline keep theirs
            schedules = (values.pop("pipeline_schedule"),)
        fractions = tuple(args.offload_fractions)
        if values.pop("optimizer_cpu_offload", False):
            fractions = (values.pop("optimizer_offload_fraction", 1.0),)
        found = enumerate_plans(values, args.world_size, memory, hardware, schedules, fractions, args.all_layouts)
    except UserError as error:
        print(f"plan_layout.py: error: {error}", file=sys.stderr)
        return 2
    plans, refused = found.plans, found.refused
    if not plans and not found.over_in_state:
        print(f"plan_layout.py: error: {_refusal_of_all(refused)}", file=sys.stderr)
        return 2
    if not any(plan.fits for plan in plans):
        print(f"plan_layout.py: error: {_none_fits(values, args, memory, hardware, schedules, fractions)}",
              file=sys.stderr)
        return 1
    top = args.top or None
    if args.json:
        print(json.dumps({"world_size": args.world_size, "gpu_memory_bytes": memory,
                          "refused_by_validation": refused.total(),
                          "not_planned_state_over_memory": found.over_in_state,
                          "layouts": [report.plan_record(plan) for plan in plans[:top]]}, indent=1))
        return 0
    fitting = [plan for plan in plans if plan.fits]
    print(f"{len(plans)} valid layouts ({refused.total()} refused by validation), {len(fitting)} fit in "
          f"{args.gpu_memory_gib:g} GiB; fastest first:")
    if found.over_in_state:
        print(f"({found.over_in_state} more not planned: their parameters, gradients and optimizer state alone "
              f"exceed {args.gpu_memory_gib:g} GiB; --all-layouts plans them too)")
    if schedules != ("1f1b",):
        print(f"(--pipeline-schedule {' / '.join(schedules)} for pipelined layouts without virtual stages; "
              "the others run without pipelining or interleaved 1F1B)")
    print("\n".join(report.table_lines(plans, top)))
    if fitting:
        print("\nthe fastest that fits, per rank:")
        print("\n".join(report.plan_lines(fitting[0])))
    return 0


def _none_fits(values: dict, args, memory: int, hardware, schedules, fractions) -> str:
    """Why no layout of --world-size fits, with the smallest world size that has one (doubling the ranks, up to
    SEARCH_LIMIT times the ranks given)."""
    from megatron_lite.planning.layouts import enumerate_plans

    ranks = "1 rank" if args.world_size == 1 else f"{args.world_size} ranks"
    head = f"no layout of {ranks} fits in {args.gpu_memory_gib:g} GiB per rank"
    world_size = args.world_size * 2
    while world_size <= args.world_size * SEARCH_LIMIT:
        found = enumerate_plans(values, world_size, memory, hardware, schedules, fractions)
        if any(plan.fits for plan in found.plans):
            return f"{head}; the smallest power-of-two multiple of it with one is --world-size {world_size}"
        world_size *= 2
    return (f"{head}, nor does one of any power-of-two multiple up to {args.world_size * SEARCH_LIMIT} ranks; more "
            f"memory per rank, or a smaller model")


def _refusal_of_all(refused: Counter) -> str:
    """Why validation refused every candidate: the problems every refusal names, else the commonest refusals."""
    shared = set.intersection(*(set(message.split("; ")) for message in refused))
    if shared:
        return "; ".join(sorted(shared))
    return "validation refused every layout: " + " | ".join(message for message, _ in refused.most_common(3))


def _check_one(values: dict, args, memory: int, hardware: Hardware) -> int:
    """Plan the one layout the flags give; refuse it (status 1) when a rank does not fit."""
    from megatron_lite.planning import report
    from megatron_lite.planning.layouts import plan_layout

    config = make_config(values, args.world_size)
    plan = plan_layout(config, memory, hardware)
    if args.json:
        print(json.dumps(report.plan_record(plan), indent=1))
    else:
        print("\n".join(report.plan_lines(plan)))
    if not plan.fits:
        print(f"plan_layout.py: {report.refusal(plan)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
