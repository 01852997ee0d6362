"""Pipeline bubble: the idle fraction each schedule measures on every stage, against theory.

Runs the real schedules (1F1B, interleaved 1F1B, GPipe and ZB-H1, real gloo p2p on one CPU process per
stage) over model chunks whose forward takes a fixed time t / v and whose backward twice that, as a
transformer's roughly does: t / v for the input gradient (B) and t / v for the weight gradient (W), the
two parts ZB-H1 runs apart. The compute is a sleep, so stages sharing a few CPU cores do not slow each
other down and the figure isolates the schedule. With equal stages the bubble of 1F1B and GPipe is
(p - 1) / m of the compute, v virtual stages cut it to (p - 1) / (v m), and ZB-H1's is
(p - 1)(t_F + t_B - t_W) / (m (t_F + t_B + t_W)) = (p - 1) / (3 m), a third of 1F1B's. Measured here per
stage as idle / busy time from the schedule's timeline (ScheduleStats); idle includes the sends and
receives, and a stage that finishes its part of the step early idles until the last one does. Also
reported per stage: the peak of micro-batches live (forward run, B not yet) and held (activations kept,
until W where the backward is split). Prints each layout's figures, the ratio to theory, each schedule's
bubble over 1F1B's at p = 4, and a timeline of one step per stage (F/B/W = forward, backward or its
input-gradient part, weight-gradient part of chunk 0; f/b of chunk 1; '.' idle); appends the figures
with date, machine and command to benchmarks/results/pipeline_bubble.jsonl.

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
from megatron_lite.config import layer_split
from megatron_lite.config.arguments import make_config
from megatron_lite.pipeline.microbatch import ScheduleStats
from megatron_lite.training import loop as training
from tests.harness import close_all_worlds, run_on_ranks

LAYOUTS = [  # (pipeline stages p, virtual stages v, micro-batches m, --pipeline-schedule)
    (2, 1, 8, "1f1b"), (4, 1, 8, "1f1b"), (4, 2, 8, "1f1b"), (4, 1, 8, "gpipe"), (2, 1, 8, "zb-h1"),
    (4, 1, 8, "zb-h1"),
]
SHAPE = {"seq_length": 32, "max_position_embeddings": 32, "hidden_size": 64, "num_attention_heads": 4,
         "micro_batch_size": 1, "vocab_size": 128, "mock_data": True}


class _Sleep(torch.autograd.Function):
    """Identity that takes `forward_s` forward and `backward_s` backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedChunk(torch.nn.Module):
    """A model chunk with fixed compute times, [s, b, h] in, [s, b, h] out: `seconds` forward, as long again
    for the input gradient (on the activation's path) and for the weight gradient (on the weight's path)."""

    def __init__(self, seconds: float, pre_process: bool):
        super().__init__()
        self.seconds = seconds
        self.pre_process = pre_process
        self.scale = torch.nn.Parameter(torch.ones(()))
        # The first stage's input path leads to a weight, as the embedding does: its backward is 2 t as well.
        self.embedding = torch.nn.Parameter(torch.ones(())) if pre_process else None
        self.input_tensor = None

    def set_input_tensor(self, tensor):
        self.input_tensor = tensor

    def forward(self, batch):
        x = batch * self.embedding if self.pre_process else self.input_tensor
        return _Sleep.apply(x, self.seconds, self.seconds) * _Sleep.apply(self.scale, 0.0, self.seconds)


def forward_step(data_iterator, model):
    output = model(next(data_iterator))

    def loss_func(out):
        loss_sum = out.float().sum()
        return loss_sum, torch.tensor(float(out.numel())), {}

    return output, loss_func


def _batches(shape):
    while True:
        yield torch.randn(shape)


def measure(p: int, v: int, m: int, schedule_name: str, forward_s: float, steps: int) -> dict:
    """On each of p ranks: per-step idle and busy time of this stage, and one step's timeline."""
    values = {**SHAPE, "num_layers": p * v, "pipeline_model_parallel_size": p, "global_batch_size": m,
              "pipeline_schedule": schedule_name}
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
            "peak_held": measured[-1].peak_held,
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
    """One stage's step as characters of `slot_s` each: F/B/W chunk 0, f/b chunk 1, '.' idle."""
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
    for p, v, m, schedule in LAYOUTS:
        stages = sorted(run_on_ranks(p, measure, p, v, m, schedule, forward_s, args.steps), key=lambda r: r["stage"])
        per_stage = bubble_per_stage(stages)
        measured = sum(per_stage) / p
        theory = (p - 1) / (v * m) / (3 if schedule == "zb-h1" else 1)
        name = {"1f1b": "interleaved 1F1B" if v > 1 else "1F1B", "gpipe": "GPipe", "zb-h1": "ZB-H1"}[schedule]
        figures.append({"p": p, "v": v, "m": m, "schedule": name, "theory": theory, "measured": measured,
                        "measured_per_stage": per_stage, "ratio_to_theory": measured / theory,
                        "step_s": max(max(s["step_s"]) for s in stages),
                        "peak_live_per_stage": [s["peak_live"] for s in stages],
                        "peak_held_per_stage": [s["peak_held"] for s in stages]})
        slot = forward_s / v / 2
        width = int(max(s["step_s"][-1] for s in stages) / slot) + 1
        key = f"p{p}_v{v}_m{m}_{schedule}"
        timelines[key] = [render(s, slot, width) for s in stages]
        print(f"p={p} v={v} m={m} {name:>16}: bubble measured {measured:.3f} (per stage "
              f"{', '.join(f'{x:.3f}' for x in per_stage)}) theory {theory:.3f} ratio {measured / theory:.2f}; "
              f"step {figures[-1]['step_s'] * 1e3:.0f} ms; peak micro-batches per stage live "
              f"{figures[-1]['peak_live_per_stage']} held {figures[-1]['peak_held_per_stage']}")
        for stage, line in enumerate(timelines[key]):
            print(f"    stage {stage} |{line}|")
    close_all_worlds()
    at_p4 = {f["schedule"]: f["measured"] for f in figures if f["p"] == 4}
    over_1f1b = {name: bubble / at_p4["1F1B"] for name, bubble in at_p4.items() if name != "1F1B"}
    print("p=4, bubble over 1F1B's: " + ", ".join(f"{name} {ratio:.3f}" for name, ratio in over_1f1b.items())
          + " (theory: interleaved v=2 0.5, GPipe 1, ZB-H1 0.333)")
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip() or platform.platform()
    record_result("pipeline_bubble", {"forward_ms": args.forward_ms, "backward_ms": 2 * args.forward_ms,
                                      "backward_split_ms": {"input": args.forward_ms, "weight": args.forward_ms},
                                      "steps": args.steps, "uname": uname, "layouts": figures,
                                      "bubble_over_1f1b_p4": over_1f1b, "timelines": timelines}, sys.argv)


if __name__ == "__main__":
    main()
