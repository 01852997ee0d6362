"""Context parallelism at a long sequence: activation memory and step time per rank for CP 1, 2 and 4.

Each CP size runs on its own gloo world of cp CPU processes (one thread each, tests/harness.py) and does
forward + backward of one micro-batch of --seq-length tokens through a small Llama (GQA, RoPE). Per rank:

  saved activations   bytes autograd keeps for backward, parameters excluded: what CP divides by cp
  peak step memory    growth of the process's peak RSS during the step (VmHWM reset before it; large
                      allocations go straight to mmap so freed memory is returned), which also counts
                      transient buffers: score blocks, K/V in flight, the gathered K/V of allgather, the
                      whole-sequence q/k/v of a2a (for its nh/cp heads), a2a+p2p as 2 x cp/2
  step time           median wall time of forward + backward (communication included)

CP 1 (single device, torch SDPA) is the peer: ratios are printed against it, and the figures appended
to benchmarks/results/context_parallel.jsonl with date, machine and command. On a CPU box with fewer
cores than ranks the step times share the cores: they show overheads, not speed-ups.

    python -m benchmarks.context_parallel [--seq-length 4096] [--steps 3] [--cp-sizes 1 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.results_file import record_result
from megatron_lite.config.arguments import make_config
from megatron_lite.model.attention.context_parallel import get_batch_on_this_cp_rank
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import close_all_worlds, run_on_ranks

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the ranks: freed blocks leave RSS

MODEL = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 128,
         "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 384, "vocab_size": 512}


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def _reset_peak_rss() -> int:
    """Reset the peak to the current RSS and return it."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    return _peak_rss_bytes()


def measure(values: dict, cp: int, comm_type: str, steps: int) -> dict:
    """One rank: forward + backward `steps` times after a warm-up; memory of the last step."""
    hierarchical_cp = (2, cp // 2) if comm_type == "a2a+p2p" else None
    pstate = ParallelState.build(Layout(cp=cp, hierarchical_cp=hierarchical_cp)) if cp > 1 else ParallelState.single()
    config = make_config(values).model
    model = GPTModel(config, pstate, padded_vocab=values["vocab_size"], seed=1, cp_comm_type=comm_type)
    seq = values["seq_length"]
    tokens = torch.randint(0, values["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = get_batch_on_this_cp_rank({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                                       "position_ids": torch.arange(seq)}, pstate)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    times = []
    for step in range(steps + 1):
        saved.clear()
        model.zero_grad(set_to_none=False)
        before = _reset_peak_rss()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(batch["tokens"], batch["position_ids"], batch["labels"]).sum()
        loss.backward()
        if step:
            times.append(time.perf_counter() - start)
    return {"saved_activation_bytes": sum(saved.values()), "peak_step_bytes": _peak_rss_bytes() - before,
            "step_time_s": statistics.median(times)}


def _comm_types(cp: int) -> tuple[str, ...]:
    """The --cp-comm-types to measure at `cp`; a2a+p2p as 2 x cp/2 once there are two groups of 2."""
    if cp == 1:
        return ("none",)
    return ("p2p", "allgather", "a2a", "a2a+p2p") if cp >= 4 else ("p2p", "allgather", "a2a")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    values = {**MODEL, "seq_length": args.seq_length, "max_position_embeddings": args.seq_length}
    runs = []
    for cp in args.cp_sizes:
        for comm_type in _comm_types(cp):
            ranks = run_on_ranks(cp, measure, values, cp, comm_type, args.steps, timeout=600)
            runs.append({"cp": cp, "comm_type": comm_type,
                         "saved_activation_mb": max(r["saved_activation_bytes"] for r in ranks) / 2**20,
                         "peak_step_mb": max(r["peak_step_bytes"] for r in ranks) / 2**20,
                         "step_time_s": max(r["step_time_s"] for r in ranks)})
            close_all_worlds()
    peer = next(r for r in runs if r["cp"] == 1) if 1 in args.cp_sizes else runs[0]
    print(f"seq {args.seq_length}, {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}; per rank, "
          f"worst rank; ratios vs cp {peer['cp']}")
    print(f"{'cp':>3} {'comm':>9} {'saved act MB':>13} {'ratio':>6} {'peak step MB':>13} {'ratio':>6} "
          f"{'step s':>7} {'ratio':>6}")
    for r in runs:
        r["ratios"] = {key: r[key] / peer[key] for key in ("saved_activation_mb", "peak_step_mb", "step_time_s")}
        print(f"{r['cp']:>3} {r['comm_type']:>9} {r['saved_activation_mb']:>13.1f} "
              f"{r['ratios']['saved_activation_mb']:>6.2f} {r['peak_step_mb']:>13.1f} "
              f"{r['ratios']['peak_step_mb']:>6.2f} {r['step_time_s']:>7.2f} {r['ratios']['step_time_s']:>6.2f}")
    record_result("context_parallel", {"model": values, "micro_batch_size": 1, "runs": runs,
                                       "load_average": os.getloadavg()}, sys.argv)


if __name__ == "__main__":
    main()
