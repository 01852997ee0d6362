"""One GPU: megatron_lite's training through `pretrain()` on the Llama-3.2-1B shape, against transformers.

In one run, on one device:
  1. correctness on a tiny Llama: the device's fp32 losses equal the CPU's (relative 1e-5; TF32 off), bf16
     tracks fp32 within bf16 rounding, and (where --torch-compile exists) compiled equals eager;
  2. ours: Llama-3.2-1B shape (16 layers, hidden 2048, ffn 8192, 32 heads / 8 groups, vocab 128256,
     seq 4096, tied embeddings, bf16, mock data) through `training.pretrain`, eager and with --torch-compile:
     tokens/s, TFLOP/s and MFU, peak memory, the forward-backward / gradient-reduction / optimizer split, the
     attention kernel;
  3. peers: the same model as transformers' `LlamaForCausalLM` (bf16 weights, SDPA, fused AdamW, the same
     micro-batches and clipping), eager and compiled with torch.compile.
MFU for every entry uses one formula, `model/flops.py`'s `training_flops_per_token` (PaLM's 6 N + 12 L h s per token,
N the matmul weights including the output layer), over the device's dense bf16 peak. Figures are medians
over the iterations after the warm-up. On a GPU the figures are appended, with date, device and command,
to gpu_step.jsonl in the results folder (benchmarks/results/, or $BENCHMARK_RESULTS_DIR: on a borrowed
machine whose tree does not come back, its output folder); `--tiny` runs every part on a tiny model on the CPU
(the test suite does, so the script never rots) and only prints.

    BENCHMARK_RESULTS_DIR=$OUT python -m benchmarks.gpu_step   # one H200: about 5 minutes
    python -m benchmarks.gpu_step --tiny                       # CPU, under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.config.arguments import make_config
from megatron_lite.model.flops import training_flops_per_token
from megatron_lite.training.logging import device_peak_tflops
from megatron_lite.training.loop import pretrain

LLAMA_1B = {"num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 32,
            "num_query_groups": 8, "vocab_size": 128256, "seq_length": 4096, "max_position_embeddings": 4096,
            "rotary_base": 500000.0, "untie_embeddings_and_output_weights": False}
TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2,
        "vocab_size": 256, "seq_length": 64, "max_position_embeddings": 64, "rotary_base": 10000.0,
        "untie_embeddings_and_output_weights": False}


def run_config(shape: dict, device: torch.device, *, bf16: bool, micro_batch: int, microbatches: int, iters: int,
               **extra):
    return make_config({"model_preset": "llama-tiny", "mock_data": True, **shape, "bf16": bf16,
                        "device": device.type, "micro_batch_size": micro_batch,
                        "global_batch_size": micro_batch * microbatches, "train_iters": iters,
                        "lr": 3e-4, "lr_warmup_iters": 0, "eval_iters": 0, "log_interval": max(iters // 4, 1),
                        "make_vocab_size_divisible_by": 128, **extra})


def measured(records: list[dict], warmup: int, key: str) -> float:
    return statistics.median(r[key] for r in records[warmup:])


# -------------------------------------------------------------------------------------------------------
# Ours


def ours(shape: dict, device: torch.device, *, bf16: bool, micro_batch: int, microbatches: int, iters: int,
         warmup: int, compiled: bool) -> dict:
    """tokens/s, MFU, peak memory and the phase split of `pretrain()` on `shape`, eager or with --torch-compile."""
    config = run_config(shape, device, bf16=bf16, micro_batch=micro_batch, microbatches=microbatches, iters=iters,
                        torch_compile=compiled)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    figures = {key: measured(records, warmup, key) for key in
               ("tokens_per_sec", "tflops_per_device", "time_forward_backward_ms", "time_grad_reduce_ms",
                "time_optimizer_ms", "time_data_wait_ms", "iteration_time_s")}
    figures["peak_memory_gib"] = max(r["memory_gib"] for r in records)
    figures["final_loss"] = records[-1]["lm_loss"]
    if "mfu" in records[-1]:
        figures["mfu"] = measured(records, warmup, "mfu")
    figures["attention_kernels"] = attention_kernels(config, device)
    return figures


def attention_kernels(config, device: torch.device) -> list[str]:
    """The aten attention ops that one forward of a one-layer model of this shape runs (profiled)."""
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.state import ParallelState
    from megatron_lite.training.loop import padded_vocab_for, params_dtype

    one_layer = dataclasses.replace(config.model, num_layers=1)
    model = GPTModel(one_layer, ParallelState.single(), padded_vocab=padded_vocab_for(config), seed=1,
                     device=device).to(params_dtype(config))
    seq = one_layer.seq_length
    ids = torch.randint(0, one_layer.vocab_size, (1, seq), device=device)
    with torch.no_grad(), torch.profiler.profile() as profile:
        model(ids, torch.arange(seq, device=device))
    return sorted({e.name for e in profile.events() if "scaled_dot_product" in e.name or "flash_attn" in e.name})


# -------------------------------------------------------------------------------------------------------
# transformers peers


def transformers_peer(shape: dict, device: torch.device, *, bf16: bool, micro_batch: int, microbatches: int,
                      iters: int, warmup: int, compiled: bool) -> dict:
    """tokens/s and peak memory of LlamaForCausalLM trained with the same batches, clipping and AdamW."""
    import transformers

    m = run_config(shape, device, bf16=bf16, micro_batch=micro_batch, microbatches=microbatches, iters=iters).model
    hf_config = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_epsilon,
        rope_theta=m.rotary_base, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
        attn_implementation="sdpa")
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = transformers.LlamaForCausalLM(hf_config).to(device=device, dtype=dtype).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01,
                                  fused=device.type == "cuda")
    forward = torch.compile(model) if compiled else model
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    batches = [torch.randint(0, m.vocab_size, (micro_batch, m.seq_length), device=device) for _ in range(microbatches)]
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        for ids in batches:
            (forward(input_ids=ids, labels=ids).loss / microbatches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    tokens = micro_batch * microbatches * m.seq_length
    figures = {"tokens_per_sec": statistics.median(tokens / s for s in seconds[warmup:])}
    figures["tflops_per_device"] = figures["tokens_per_sec"] * training_flops_per_token(m) / 1e12
    peak = device_peak_tflops(device, None)
    if peak:
        figures["mfu"] = figures["tflops_per_device"] / peak
    if device.type == "cuda":
        figures["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return figures


# -------------------------------------------------------------------------------------------------------
# Correctness on the device


def losses(device: torch.device, bf16: bool, **extra) -> list[float]:
    config = run_config(TINY, device, bf16=bf16, micro_batch=2, microbatches=2, iters=5, **extra)
    return [r["lm_loss"] for r in pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)]


def relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def correctness(device: torch.device) -> dict:
    """Tiny Llama, 5 steps: fp32 on `device` vs fp32 on the CPU, bf16 vs fp32 on `device`, and fp32 with
    --torch-compile vs eager on `device`."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cpu, fp32, bf16 = losses(torch.device("cpu"), False), losses(device, False), losses(device, True)
    compiled = losses(device, False, torch_compile=True)
    checks = {"fp32_vs_cpu": {"relative_gap": relative_gap(fp32, cpu), "tolerance": 1e-5},
              "bf16_vs_fp32": {"relative_gap": relative_gap(bf16, fp32), "tolerance": 2e-2},
              "compiled_vs_eager": {"relative_gap": relative_gap(compiled, fp32), "tolerance": 1e-5}}
    for check in checks.values():
        check["passed"] = check["relative_gap"] <= check["tolerance"]
    return checks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU, every part, print only")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    shape, bf16 = (TINY, False) if args.tiny else (LLAMA_1B, True)
    iters, warmup = (4, 1) if args.tiny else (args.iters, 3)
    run = {"bf16": bf16, "micro_batch": args.micro_batch_size, "microbatches": args.microbatches, "iters": iters,
           "warmup": warmup}
    started = time.perf_counter()
    figures = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "shape": shape, "micro_batch_size": args.micro_batch_size, "microbatches": args.microbatches,
               "correctness": correctness(device)}
    for name, compiled in (("megatron_lite", False), ("megatron_lite_compiled", True)):
        figures[name] = ours(shape, device, **run, compiled=compiled)
    for name, compiled in (("transformers_eager", False), ("transformers_compiled", True)):
        figures[name] = transformers_peer(shape, device, **run, compiled=compiled)
    for ours_name in ("megatron_lite", "megatron_lite_compiled"):
        for peer in ("transformers_eager", "transformers_compiled"):
            figures[f"ratio_{ours_name}_vs_{peer}"] = (figures[ours_name]["tokens_per_sec"]
                                                      / figures[peer]["tokens_per_sec"])
    figures["seconds"] = time.perf_counter() - started
    print(json.dumps(figures, indent=1))
    if not args.tiny:
        record_result("gpu_step", figures, [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    return figures


if __name__ == "__main__":
    main()
