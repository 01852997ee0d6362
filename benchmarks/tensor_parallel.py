"""Tensor parallelism on CPU: per-rank parameter memory at TP 1/2/4, and step time TP1 vs TP2 on two processes.

    python -m benchmarks.tensor_parallel [--steps 5] [--micro-batch-size 4] [--rounds 2]

Memory: the model is built at TP 1, 2 and 4 on a 4-process gloo world and each rank's parameters are
counted by kind: the transformer layers' weight matrices (split 1/tp), the vocabulary tables (split
1/tp, padded vocabulary included) and the replicated ones (norms, row-parallel biases, positions).

Step time: the same model, global batch and optimizer trained through training.pretrain (mock data) on
two processes of one thread each, as TP1 x DP2 (the peer: same hardware, same batch), TP2 and TP2 with
sequence parallelism, plus TP1 on one process. Each training.train_step is timed (wall and this
process's CPU time); the layouts run interleaved for --rounds rounds and the fastest step after two
warm-up steps is reported, since other processes on a shared machine only ever slow a step down. CPU
seconds per rank show the compute split; wall minus CPU is time spent waiting in collectives. The
losses of all layouts must agree. Figures go to benchmarks/results/tensor_parallel.jsonl with the
date, machine and command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.config import layer_split
from megatron_lite.config.arguments import make_config
from megatron_lite.parallel.state import Layout, ParallelState
from megatron_lite.training import loop as training
from tests.harness import run_on_ranks

SHAPE = {"model_preset": "llama-tiny", "num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688,
         "num_attention_heads": 8, "num_query_groups": 4, "seq_length": 256, "max_position_embeddings": 256,
         "vocab_size": 8192, "mock_data": True, "eval_interval": 10_000, "log_interval": 10_000, "lr": 1e-3}


def parameter_bytes(tp: int) -> dict:
    """This rank's parameter bytes by kind, for the model at tensor-parallel size `tp`."""
    config = make_config({**SHAPE, "tensor_model_parallel_size": tp}, 4)
    pstate = ParallelState.build(Layout.from_world(4, tp=tp))
    plan = layer_split.model_chunk_plans(config, 0)[0]
    model = pretrain_gpt.model_provider(config, pstate, plan, torch.device("cpu"))
    kinds = {"layer_weights": 0, "vocabulary": 0, "replicated": 0}
    for param in model.parameters():
        if param.spec.tp_dim is None:
            kind = "replicated"
        elif param.spec.valid_rows is not None:
            kind = "vocabulary"
        else:
            kind = "layer_weights"
        kinds[kind] += param.numel() * param.element_size()
    kinds["total"] = sum(kinds.values())
    return kinds


def memory_per_rank() -> dict:
    return {tp: parameter_bytes(tp) for tp in (1, 2, 4)}


def step_times(values: dict, world_size: int) -> dict:
    """Wall and CPU seconds of each training step of one run (training.train_step timed), and the losses."""
    wall, cpu = [], []
    untimed = training.train_step

    def timed(*args, **kwargs):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        metrics = untimed(*args, **kwargs)
        wall.append(time.perf_counter() - start_wall)
        cpu.append(time.process_time() - start_cpu)
        return metrics

    training.train_step = timed
    try:
        history = training.pretrain(make_config(values, world_size), pretrain_gpt.model_provider,
                                    pretrain_gpt.forward_step)
    finally:
        training.train_step = untimed
    return {"wall": wall, "cpu": cpu, "losses": [h["lm_loss"] for h in history]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)

    memory = run_on_ranks(4, memory_per_rank)[0]
    base = memory[1]
    print("per-rank parameter memory (MiB) and fraction of TP1")
    for tp, kinds in memory.items():
        print(f"  TP{tp}: " + " | ".join(f"{kind} {size / 2**20:.2f} ({size / base[kind]:.3f})"
                                         for kind, size in kinds.items()))

    train = {**SHAPE, "train_iters": args.steps, "micro_batch_size": args.micro_batch_size,
             "global_batch_size": 2 * args.micro_batch_size}
    layouts = {"tp1_1proc": ({**train, "micro_batch_size": 2 * args.micro_batch_size}, 1),
               "tp1_dp2": (train, 2),
               "tp2": ({**train, "tensor_model_parallel_size": 2, "micro_batch_size": 2 * args.micro_batch_size}, 2),
               "tp2_sp": ({**train, "tensor_model_parallel_size": 2, "sequence_parallel": True,
                           "micro_batch_size": 2 * args.micro_batch_size}, 2)}
    runs = {name: [] for name in layouts}
    for _ in range(args.rounds):  # rounds interleave the layouts, so that load from elsewhere hits them alike
        for name, (values, world_size) in layouts.items():
            if world_size == 1:
                runs[name].append(step_times(values, 1))
            else:
                runs[name].extend(run_on_ranks(world_size, step_times, values, world_size))
    # Per layout: the fastest step after the two warm-up steps (wall), and the median CPU time of a rank.
    step_s = {name: min(t for run in rs for t in run["wall"][2:]) for name, rs in runs.items()}
    cpu_s = {name: statistics.median(t for run in rs for t in run["cpu"][2:]) for name, rs in runs.items()}
    tokens = train["global_batch_size"] * SHAPE["seq_length"]
    print(f"step time for a global batch of {tokens} tokens (fastest step, wall), CPU seconds per rank and step, "
          f"speed-up over TP1 x DP2 on the same two processes")
    for name in layouts:
        print(f"  {name:10s} {step_s[name]:.3f} s  {tokens / step_s[name]:8.0f} tokens/s  cpu/rank "
              f"{cpu_s[name]:.3f} s  x{step_s['tp1_dp2'] / step_s[name]:.2f}")
    reference = runs["tp1_1proc"][0]["losses"]
    agree = all(abs(a - b) <= 1e-5 * abs(b) for rs in runs.values() for run in rs
                for a, b in zip(run["losses"], reference))
    print(f"losses agree across layouts to rel 1e-5: {agree}")

    figures = {
        "shape": {k: v for k, v in SHAPE.items() if k not in ("mock_data", "eval_interval", "log_interval")},
        "parameter_bytes_per_rank": {f"tp{tp}": kinds for tp, kinds in memory.items()},
        "parameter_fraction_of_tp1": {f"tp{tp}": {k: round(v / base[k], 4) for k, v in kinds.items()}
                                      for tp, kinds in memory.items()},
        "global_batch_tokens": tokens, "steps": args.steps, "rounds": args.rounds, "threads_per_process": 1,
        "step_time_s": step_s, "cpu_s_per_rank_step": cpu_s,
        "speedup_vs_tp1_dp2": {k: step_s["tp1_dp2"] / v for k, v in step_s.items()},
        "losses_agree": agree, "load_average": os.getloadavg(),
    }
    record_result("tensor_parallel", figures, sys.argv)


if __name__ == "__main__":
    main()
