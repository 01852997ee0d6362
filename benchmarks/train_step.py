"""Single-process training-step throughput: megatron_lite's Llama vs the same config in transformers.

Both sides run the same model shape with the same weights, batch and optimizer (AdamW, same
hyper-parameters): forward, loss, backward, optimizer step. Ours goes through the real training stack
(gradient buffers, finalize, clipping). Prints tokens/s of each and the ratio, and appends the figures
with date, machine and command to benchmarks/results/train_step.jsonl.

    python benchmarks/train_step.py [--steps 10] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import transformers

from benchmarks.results_file import record_result
from megatron_lite.config import make_config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.hf import weights
from megatron_lite.hf.checkpoint import load_into_model
from megatron_lite.model.gpt import GPTModel
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.optim.grad_buffer import DistributedDataParallel
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState

SHAPE = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688, "num_attention_heads": 8,
         "num_query_groups": 4, "seq_length": 256, "max_position_embeddings": 256, "vocab_size": 8192}


def timed_steps(step, steps: int, device) -> float:
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = make_config({"model_preset": "llama-tiny", "mock_data": True, **SHAPE})
    m = config.model
    hf_config = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_epsilon,
        rope_theta=m.rotary_base, tie_word_embeddings=False, attn_implementation="sdpa")
    hf_model = transformers.LlamaForCausalLM(hf_config).to(device).train()
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    pstate = ParallelState.single()
    ours = GPTModel(m, pstate, padded_vocab=padded, seed=1, device=device).train()
    load_into_model(ours, weights.to_megatron("llama", {k: v.cpu() for k, v in hf_model.state_dict().items()}, m), 0, 1)
    ddp = DistributedDataParallel(ours, pstate)
    optimizer = Optimizer([p for p in ours.parameters()], config.optimizer, pstate)
    hf_optimizer = torch.optim.AdamW(hf_model.parameters(), lr=config.optimizer.lr, weight_decay=0.01,
                                     betas=(config.optimizer.adam_beta1, config.optimizer.adam_beta2))
    tokens = torch.randint(0, m.vocab_size, (args.micro_batch_size, m.seq_length + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(m.seq_length, device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def our_step():
        ddp.zero_grad_buffer()
        with autocast:
            loss_sum = ddp(inputs, positions, labels=labels).float().sum()
        loss_sum.backward()
        finalize_model_grads([ddp], pstate, torch.tensor(float(labels.numel()), device=device))
        optimizer.step(config.optimizer.lr)

    def hf_step():
        with autocast:
            loss = hf_model(input_ids=inputs, labels=tokens[:, :-1]).loss  # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), config.optimizer.clip_grad)
        hf_optimizer.step()
        hf_optimizer.zero_grad(set_to_none=True)

    tokens_per_run = args.steps * inputs.numel()
    results = {}
    for name, step in (("megatron_lite", our_step), ("transformers", hf_step)):
        seconds = timed_steps(step, args.steps, device)
        results[name] = tokens_per_run / seconds
        print(f"{name:>14}: {results[name]:,.0f} tokens/s ({seconds / args.steps * 1000:.1f} ms/step)")
    ratio = results["megatron_lite"] / results["transformers"]
    print(f"ratio megatron_lite / transformers: {ratio:.3f}")
    record_result("train_step", {"config": SHAPE, "micro_batch_size": args.micro_batch_size, "device": str(device),
                                 "tokens_per_sec": results, "ratio": ratio}, sys.argv)


if __name__ == "__main__":
    main()
