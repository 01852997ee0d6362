"""The loss over the vocabulary: megatron_lite's vocab-parallel cross-entropy vs torch's F.cross_entropy.

The logits are a language model's largest activation, so the loss's memory matters: this measures the
peak memory of forward + backward (from torch.profiler's memory timeline, on the CPU or a GPU) and the
time, for bf16 and fp32 logits of [s, b, v] with a padded vocabulary, against F.cross_entropy on the
same logits upcast to fp32 (its usual use in mixed precision), in units of one fp32 copy of the logits.
Appends the figures to benchmarks/results/cross_entropy.jsonl.

    python -m benchmarks.cross_entropy [--seq 1024] [--batch 2] [--vocab 32000] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler._memory_profiler import MemoryProfileTimeline

from benchmarks.results_file import record_result
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.model.tensor_parallel import vocab_parallel_cross_entropy
from megatron_lite.parallel.state import ParallelState


def peak_bytes(step, device: torch.device) -> int:
    """Peak bytes held by tensors while `step` runs, from the profiler's memory timeline."""
    with torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True) as profile:
        step()
    _, sizes = MemoryProfileTimeline(profile._memory_profile())._coalesce_timeline(device)
    return max(sum(s) for s in sizes)


def seconds_per_call(step, device: torch.device, repeats: int = 3) -> float:
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    padded = padded_vocab_size(args.vocab, 128, 1)
    target = torch.randint(0, args.vocab, (args.seq, args.batch), device=device)
    fp32_logits_bytes = args.seq * args.batch * padded * 4
    figures = {"seq": args.seq, "batch": args.batch, "vocab": args.vocab, "padded_vocab": padded,
               "device": str(device)}
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(args.seq, args.batch, padded, dtype=dtype, device=device)

        def ours(logits=logits):
            leaf = logits.clone().requires_grad_()
            vocab_parallel_cross_entropy(leaf, target, ParallelState.single(), args.vocab).sum().backward()

        def torch_peer(logits=logits):
            leaf = logits.clone().requires_grad_()
            F.cross_entropy(leaf[..., :args.vocab].float().view(-1, args.vocab), target.view(-1),
                            reduction="none").sum().backward()

        for name, step in (("megatron_lite", ours), ("F.cross_entropy", torch_peer)):
            entry = {"peak_in_fp32_logits": peak_bytes(step, device) / fp32_logits_bytes,
                     "ms": 1e3 * seconds_per_call(step, device)}
            figures[f"{name} {str(dtype).removeprefix('torch.')}"] = entry
            print(f"{name:>16} {dtype}: peak {entry['peak_in_fp32_logits']:.2f} x fp32 logits, "
                  f"{entry['ms']:.0f} ms forward + backward", flush=True)
    record_result("cross_entropy", figures, sys.argv)


if __name__ == "__main__":
    main()
