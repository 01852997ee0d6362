"""Pipeline bubble: the idle fraction each schedule measures on every stage, against (p - 1) / (v m).

Runs the real schedules (forward_backward_pipelining_without_interleaving / _with_interleaving, real gloo
p2p on one CPU process per stage) over model chunks whose forward takes a fixed time t_f / v and whose
backward takes twice that, as a transformer's roughly does. The compute is a sleep, so stages sharing a
few CPU cores do not slow each other down and the figure isolates the schedule: with equal stages the
1F1B bubble is (p - 1) / m of the compute, and v virtual stages cut it to (p - 1) / (v m). Measured here
per stage as idle / busy time from the schedule's timeline (ScheduleStats); idle includes the sends and
receives, and a stage that finishes its part of the step early idles until the last one does. Prints
each layout's figures, the ratio to theory, the interleaved/1F1B ratio at p = 4, and a timeline of one
step per stage (F/B = forward/backward of chunk 0, f/b of chunk 1, '.' idle); appends the figures with
date, machine and command to benchmarks/results/pipeline_bubble.jsonl.

    python -m benchmarks.pipeline_bubble [--forward-ms 50] [--steps 4]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.results_file import record_result
from megatron_lite import training
from megatron_lite.config import make_config
from megatron_lite.pipeline import layer_split
from megatron_lite.pipeline.schedules import ScheduleStats
from tests.harness import close_all_worlds, run_on_ranks

LAYOUTS = [(2, 1, 8), (4, 1, 8), (4, 2, 8)]  # (pipeline stages p, virtual stages v, micro-batches m)
SHAPE = {"seq_length": 32, "max_position_embeddings": 32, "hidden_size": 64, "num_attention_heads": 4,
         "micro_batch_size": 1, "vocab_size": 128, "mock_data": True}


class _Sleep(torch.autograd.Function):
    """Identity that takes `seconds` forward and twice that backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class TimedChunk(torch.nn.Module):
    """A model chunk with a fixed compute time: [s, b, h] in, [s, b, h] out."""

    def __init__(self, seconds: float, pre_process: bool):
        super().__init__()
        self.seconds = seconds
        self.pre_process = pre_process
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, batch):
        x = batch if self.pre_process else self.input_tensor
        return _Sleep.apply(x * self.scale, self.seconds)


def forward_step(data_iterator, model):
    output = model(next(data_iterator))

    def loss_func(out):
        loss_sum = out.float().sum()
        return loss_sum, torch.tensor(float(out.numel())), {}

    return output, loss_func


def _batches(shape):
    while True:
        yield torch.randn(shape)


def measure(p: int, v: int, m: int, forward_s: float, steps: int) -> dict:
    """On each of p ranks: per-step idle and busy time of this stage, and one step's timeline."""
    values = {**SHAPE, "num_layers": p * v, "pipeline_model_parallel_size": p, "global_batch_size": m}
    if v > 1:
        values["num_layers_per_virtual_pipeline_stage"] = 1
    config = make_config(values, p)
    pstate, _ = training.initialize(config)
    plans = layer_split.model_chunk_plans(config, pstate.pp_rank)
    model = [TimedChunk(forward_s / v, plan.pre_process) for plan in plans]
    data = _batches((SHAPE["seq_length"], SHAPE["micro_batch_size"], SHAPE["hidden_size"]))
    schedule = training.get_schedule(config)
    measured = []
    for step in range(steps + 1):  # the first step warms up the process groups
        dist.barrier()
        stats = ScheduleStats()
        schedule(forward_step, data, model, m, pstate=pstate, config=config, stats=stats)
        if step:
            measured.append(stats)
    return {"stage": pstate.pp_rank, "step_s": [s.total_time for s in measured],
            "busy_s": [s.busy_time for s in measured], "peak_live": measured[-1].peak_live,
            "events": [(k, c, mb, t0 - measured[-1].start, t1 - measured[-1].start)
                       for k, c, mb, t0, t1 in measured[-1].events]}


def bubble_per_stage(stages: list[dict]) -> list[float]:
    """Idle / busy time of each stage within the pipeline's step, the median over steps. The step lasts
    until the last stage finishes (all start together after a barrier), so a stage that finishes early
    idles until then."""
    steps = range(len(stages[0]["step_s"]))
    step_s = [max(s["step_s"][i] for s in stages) for i in steps]
    return [statistics.median((step_s[i] - s["busy_s"][i]) / s["busy_s"][i] for i in steps) for s in stages]


def render(stage: dict, slot_s: float, width: int) -> str:
    """One stage's step as characters of `slot_s` each: F/B chunk 0, f/b chunk 1, '.' idle."""
    line = ["."] * width
    for kind, chunk, _, start, end in stage["events"]:
        char = kind if chunk == 0 else kind.lower()
        for slot in range(int(round(start / slot_s)), min(int(round(end / slot_s)), width)):
            line[slot] = char
    return "".join(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-ms", type=float, default=50.0, help="forward time of one stage per micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per layout (after one warm-up)")
    args = parser.parse_args()
    forward_s = args.forward_ms / 1000
    figures, timelines = [], {}
    for p, v, m in LAYOUTS:
        stages = sorted(run_on_ranks(p, measure, p, v, m, forward_s, args.steps), key=lambda r: r["stage"])
        per_stage = bubble_per_stage(stages)
        measured = sum(per_stage) / p
        theory = (p - 1) / (v * m)
        schedule = "interleaved 1F1B" if v > 1 else "1F1B"
        figures.append({"p": p, "v": v, "m": m, "schedule": schedule, "theory": theory, "measured": measured,
                        "measured_per_stage": per_stage, "ratio_to_theory": measured / theory,
                        "step_s": max(max(s["step_s"]) for s in stages),
                        "peak_live_per_stage": [s["peak_live"] for s in stages]})
        slot = forward_s / v / 2
        width = int(max(s["step_s"][-1] for s in stages) / slot) + 1
        timelines[f"p{p}_v{v}_m{m}"] = [render(s, slot, width) for s in stages]
        print(f"p={p} v={v} m={m} {schedule:>16}: bubble measured {measured:.3f} (per stage "
              f"{', '.join(f'{x:.3f}' for x in per_stage)}) theory (p-1)/(v m) = {theory:.3f} "
              f"ratio {measured / theory:.2f}; step {figures[-1]['step_s'] * 1e3:.0f} ms; "
              f"peak live micro-batches per stage {figures[-1]['peak_live_per_stage']}")
        for stage, line in enumerate(timelines[f"p{p}_v{v}_m{m}"]):
            print(f"    stage {stage} |{line}|")
    close_all_worlds()
    one, two = figures[1]["measured"], figures[2]["measured"]
    print(f"p=4: interleaved (v=2) / 1F1B bubble = {two / one:.3f} (theory 0.5)")
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip() or platform.platform()
    record_result("pipeline_bubble", {"forward_ms": args.forward_ms, "backward_ms": 2 * args.forward_ms,
                                      "steps": args.steps, "uname": uname, "layouts": figures,
                                      "interleaved_over_1f1b_p4": two / one, "timelines": timelines}, sys.argv)


if __name__ == "__main__":
    main()
