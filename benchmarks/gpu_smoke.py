"""One GPU: every path that only CUDA takes, run once at tiny size against a reference on the same device.

Checks (each reports its largest relative error, its tolerance and whether it passed):
  flex_documents     FlexAttention with the block mask of packed documents (--reset-attention-mask), forward
                     and backward, against SDPA with the explicit [b, 1, s, s] mask (on the CPU forward only:
                     FlexAttention has no CPU backward);
  cp_block_kernels   the context-parallel block kernels (torch's flash op in bf16, its memory-efficient op in
                     fp32; the CPU's flash op on the CPU) called directly: output, LSE and q/k/v gradients
                     against attention with explicit scores in fp32;
  moe_grouped_gemm   the experts' grouped product in bf16 against one matmul per expert in fp32, forward and
                     backward, naming the kernel that ran (torch._grouped_mm or the padded bmm);
  fused_adamw        three steps of torch's fused AdamW against the unfused one;
  training           a tiny Llama with dropout through pretrain(): --optimizer-cpu-offload (pinned host buffers
                     on CUDA) trains as the run on the device; a run stopped at iteration 2, saved and resumed
                     (the CUDA RNG tracker's states in the checkpoint) continues as the uninterrupted one;
                     the phase timers (CUDA events on a GPU) report every phase; --profile writes a trace.

    BENCHMARK_RESULTS_DIR=$OUT python -m benchmarks.gpu_smoke   # one GPU: under two minutes
    python -m benchmarks.gpu_smoke --cpu                        # the same checks on the CPU (the test suite)

Prints every check as JSON; on a GPU also appends them, with date, device and command, to gpu_smoke.jsonl in
the results folder (benchmarks/results_file.py). Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.config.arguments import make_config
from megatron_lite.model.attention.context_parallel import choose_block_kernel
from megatron_lite.model.attention.self_attention import Documents, flex_document_attention
from megatron_lite.model.moe import experts as moe_experts
from megatron_lite.training.loop import pretrain


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| over max |expected|."""
    actual, expected = actual.detach().float().cpu(), expected.detach().float().cpu()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def verdict(errors: dict[str, float], tolerance: float, **details) -> dict:
    worst = max(errors.values())
    return {"errors": errors, "tolerance": tolerance, "passed": worst <= tolerance, **details}


def random(*shape, device, dtype=torch.float32, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(device, dtype).requires_grad_()


def check_flex_documents(device: torch.device) -> dict:
    generator = torch.Generator().manual_seed(0)
    b, nh, ng, s, d = 2, 4, 2, 256, 32
    ids = torch.cat([torch.zeros(b, 100), torch.ones(b, 60), torch.full((b, 96), 2.0)], dim=1).long()
    documents = Documents(ids, device)
    backward = device.type == "cuda"
    q = random(b, nh, s, d, device=device, generator=generator).requires_grad_(backward)
    k, v = (random(b, ng, s, d, device=device, generator=generator).requires_grad_(backward) for _ in range(2))
    out = flex_document_attention(q, k, v, documents)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=documents.attention_mask, enable_gqa=True)
    errors = {"out": relative_error(out, reference)}
    if backward:
        dout = torch.randn(out.shape, generator=generator).to(device)
        got = torch.autograd.grad(out, (q, k, v), dout)
        expected = torch.autograd.grad(reference, (q, k, v), dout)
        errors.update({f"d{name}": relative_error(a, e) for name, a, e in zip("qkv", got, expected)})
    return verdict(errors, 1e-4, backward=backward)


def explicit_attention(q, k, v, causal: bool, scale: float):
    """fp32 attention with explicit scores: q/k/v [b, s, n, d] -> out [b, sq, n, d], lse [b, n, sq]."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v).transpose(1, 2), lse


def check_cp_block_kernels(device: torch.device) -> dict:
    results = {}
    dtypes = (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,)
    for dtype in dtypes:
        kernel = choose_block_kernel("sdpa", device, dtype)
        generator = torch.Generator().manual_seed(0)
        b, n, d, scale = 2, 4, 64, 0.125
        for sq, sk, causal in ((128, 128, True), (48, 128, False)):
            q = random(b, sq, n, d, device=device, dtype=dtype, generator=generator)
            k, v = (random(b, sk, n, d, device=device, dtype=dtype, generator=generator) for _ in range(2))
            dout = torch.randn(b, sq, n, d, generator=generator).to(device, dtype)
            out, lse = kernel.forward(q.detach(), k.detach(), v.detach(), causal, scale)
            grads = kernel.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal, scale)
            reference, reference_lse = explicit_attention(q, k, v, causal, scale)
            expected = torch.autograd.grad(reference, (q, k, v), dout.float())
            errors = {"out": relative_error(out, reference), "lse": relative_error(lse[..., :sq], reference_lse),
                      **{f"d{name}": relative_error(g, e) for name, g, e in zip("qkv", grads, expected)}}
            tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-3
            results[f"{kernel.__name__} {str(dtype).removeprefix('torch.')} {sq}x{sk}"] = verdict(errors, tolerance)
    return {"cases": results, "passed": all(case["passed"] for case in results.values())}


def check_moe_grouped_gemm(device: torch.device) -> dict:
    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([40, 0, 72, 16], device=device)
    x = random(int(counts.sum()), 64, device=device, dtype=torch.bfloat16, generator=generator)
    weights = [random(48, 64, device=device, dtype=torch.bfloat16, generator=generator) for _ in range(4)]
    kernel = "torch._grouped_mm" if moe_experts.grouped_mm_applies(x, weights[0]) else "padded bmm"
    out = moe_experts.experts_linear(x, weights, counts, grouped_mm=None)
    dout = torch.randn(out.shape, generator=generator).to(device, torch.bfloat16)
    got = torch.autograd.grad(out, (x, *weights), dout)
    x32, w32 = x.detach().float().requires_grad_(), [w.detach().float().requires_grad_() for w in weights]
    reference = torch.cat([rows @ w.t() for rows, w in zip(x32.split(counts.tolist()), w32)])
    expected = torch.autograd.grad(reference, (x32, *w32), dout.float(), allow_unused=True)
    errors = {"out": relative_error(out, reference), "dx": relative_error(got[0], expected[0])}
    errors.update({f"dw{e}": relative_error(g, w) for e, (g, w) in enumerate(zip(got[1:], expected[1:]))
                   if counts[e] > 0})
    return verdict(errors, 2e-2, kernel=kernel)


def check_fused_adamw(device: torch.device) -> dict:
    generator = torch.Generator().manual_seed(0)
    unfused = [torch.randn(257, 31, generator=generator).to(device).requires_grad_() for _ in range(3)]
    params = {False: unfused, True: [p.detach().clone().requires_grad_() for p in unfused]}
    grads = [[torch.randn(p.shape, generator=generator).to(device) for p in params[False]] for _ in range(3)]
    for fused, ps in params.items():
        adam = torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        for step in grads:
            for p, g in zip(ps, step):
                p.grad = g.clone()
            adam.step()
    errors = {f"param{i}": relative_error(a, b) for i, (a, b) in enumerate(zip(params[True], params[False]))}
    return verdict(errors, 1e-5)


TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
        "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 256, "seq_length": 64,
        "max_position_embeddings": 64, "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 4,
        "lr": 3e-3, "lr_warmup_iters": 0, "eval_iters": 0, "log_interval": 1, "hidden_dropout": 0.1,
        "attention_dropout": 0.1}


def train(device: torch.device, **values) -> list[dict]:
    config = make_config({**TINY, "device": device.type, **values}, 1)
    return pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)


def losses(records: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in records}


def check_training(device: torch.device, scratch: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    profile = os.path.join(scratch, "profile")
    whole = train(device, profile=True, profile_step_start=1, profile_step_end=2, profile_dir=profile)
    offloaded = train(device, optimizer_cpu_offload=True)
    save = os.path.join(scratch, "checkpoint")
    train(device, exit_interval=2, save=save, save_interval=2)
    resumed = train(device, load=save)
    reference = losses(whole)

    def gap(run: dict[int, float]) -> float:
        return max(abs(loss - reference[i]) / abs(reference[i]) for i, loss in run.items())

    errors = {"offload_vs_device": gap(losses(offloaded)), "resumed_vs_uninterrupted": gap(losses(resumed))}
    phases = ("forward_backward", "grad_reduce", "optimizer", "data_wait")
    timed = {phase: whole[-1][f"time_{phase}_ms"] for phase in phases}
    trace = os.path.join(profile, "rank0.pt.trace.json")
    result = verdict(errors, 1e-5, resumed_iterations=sorted(losses(resumed)), phase_ms=timed,
                     trace_bytes=os.path.getsize(trace) if os.path.exists(trace) else 0)
    result["passed"] = (result["passed"] and sorted(losses(resumed)) == [3, 4] and result["trace_bytes"] > 0
                        and all(timed[p] > 0 for p in ("forward_backward", "optimizer")))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU (print only)")
    args = parser.parse_args(argv)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    checks = {"flex_documents": check_flex_documents, "cp_block_kernels": check_cp_block_kernels,
              "moe_grouped_gemm": check_moe_grouped_gemm, "fused_adamw": check_fused_adamw}
    figures = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__}
    figures.update({name: check(device) for name, check in checks.items()})
    with tempfile.TemporaryDirectory() as scratch:
        figures["training"] = check_training(device, scratch)
    figures["passed"] = all(figures[name]["passed"] for name in (*checks, "training"))
    print(json.dumps(figures, indent=1))
    if not args.cpu:
        record_result("gpu_smoke", figures, [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
