"""Single-process training-step throughput: megatron_lite's Llama vs the same config in transformers.

Both sides run the same model shape with the same weights, batch and optimizer (AdamW, same
hyper-parameters): forward, loss, backward, optimizer step. Ours goes through the real training stack
(gradient buffers, finalize, clipping). With --torch-compile, ours also runs with its transformer layers
compiled (--torch-compile of pretrain_gpt.py) as a third peer; the compilation happens in the untimed
warm-up steps. Prints tokens/s of each and the ratios, and appends the figures with date, machine, command
and the machine's load average at the start to benchmarks/results/train_step.jsonl.

    python -m benchmarks.train_step [--steps 10] [--rounds 1] [--device cpu|cuda] [--torch-compile]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import transformers

from benchmarks.results_file import record_result
from megatron_lite.config.arguments import make_config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.hf import weights
from megatron_lite.hf.checkpoint import load_into_model
from megatron_lite.model.gpt import GPTModel
from megatron_lite.optim.data_parallel import DistributedDataParallel
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel.state import ParallelState, TensorSplit

SHAPE = {"num_layers": 4, "hidden_size": 256, "ffn_hidden_size": 688, "num_attention_heads": 8,
         "num_query_groups": 4, "seq_length": 256, "max_position_embeddings": 256, "vocab_size": 8192}


def seconds_per_step(steps: dict, steps_per_round: int, rounds: int, device) -> dict[str, float]:
    """Median seconds per step of each peer. Each runs two untimed warm-up steps (where compilation happens),
    then the peers take turns, `steps_per_round` steps each per round, so that a change in the load of a
    shared machine falls on all of them alike."""
    for step in steps.values():
        for _ in range(2):
            step()
    rounds_seconds = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(steps_per_round):
                step()
            _synchronize(device)
            rounds_seconds[name].append((time.perf_counter() - start) / steps_per_round)
    return {name: statistics.median(seconds) for name, seconds in rounds_seconds.items()}


def _synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def our_training_step(config, hf_model, inputs, labels, device, torch_compile: bool):
    """A function that runs one training step of megatron_lite's model, built with the transformers model's weights."""
    m, pstate = dataclasses.replace(config.model, torch_compile=torch_compile), ParallelState.single()
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    ours = GPTModel(m, pstate, padded_vocab=padded, seed=1, device=device).train()
    hf_weights = {k: v.cpu() for k, v in hf_model.state_dict().items()}
    load_into_model(ours, weights.to_megatron("llama", hf_weights, m), TensorSplit())
    ddp = DistributedDataParallel(ours, pstate)
    optimizer = Optimizer([p for p in ours.parameters()], config.optimizer, pstate)
    positions = torch.arange(m.seq_length, device=device)
    num_tokens = torch.tensor(float(labels.numel()), device=device)

    def step():
        ddp.zero_grad_buffer()
        with _autocast(device):
            loss_sum = ddp(inputs, positions, labels=labels).float().sum()
        loss_sum.backward()
        finalize_model_grads([ddp], pstate, num_tokens)
        optimizer.step(config.optimizer.lr)

    return step


def hf_training_step(config, hf_model, inputs, device):
    """A function that runs one training step of transformers' LlamaForCausalLM (AdamW, our hyper-parameters)."""
    hf_optimizer = torch.optim.AdamW(hf_model.parameters(), lr=config.optimizer.lr, weight_decay=0.01,
                                     betas=(config.optimizer.adam_beta1, config.optimizer.adam_beta2))

    def step():
        with _autocast(device):
            loss = hf_model(input_ids=inputs, labels=inputs).loss  # HF shifts labels itself
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), config.optimizer.clip_grad)
        hf_optimizer.step()
        hf_optimizer.zero_grad(set_to_none=True)

    return step


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each peer per round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of turns; each peer's median round counts")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--torch-compile", action="store_true",
                        help="also time megatron_lite with its transformer layers compiled")
    args = parser.parse_args()
    device = torch.device(args.device)
    load_at_start = [round(load, 2) for load in os.getloadavg()]  # the machine may be shared
    torch.manual_seed(0)
    config = make_config({"model_preset": "llama-tiny", "mock_data": True, **SHAPE})
    m = config.model
    hf_config = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups, max_position_embeddings=m.seq_length, rms_norm_eps=m.norm_epsilon,
        rope_theta=m.rotary_base, tie_word_embeddings=False, attn_implementation="sdpa")
    hf_model = transformers.LlamaForCausalLM(hf_config).to(device).train()
    tokens = torch.randint(0, m.vocab_size, (args.micro_batch_size, m.seq_length + 1), device=device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    steps = {"megatron_lite": our_training_step(config, hf_model, inputs, labels, device, torch_compile=False)}
    if args.torch_compile:
        steps["megatron_lite_compiled"] = our_training_step(config, hf_model, inputs, labels, device,
                                                            torch_compile=True)
    steps["transformers"] = hf_training_step(config, hf_model, inputs, device)

    results = {}
    for name, seconds in seconds_per_step(steps, args.steps, args.rounds, device).items():
        results[name] = inputs.numel() / seconds
        print(f"{name:>22}: {results[name]:,.0f} tokens/s ({seconds * 1000:.1f} ms/step)")
    ratio = results["megatron_lite"] / results["transformers"]
    print(f"ratio megatron_lite / transformers: {ratio:.3f}")
    figures = {"config": SHAPE, "micro_batch_size": args.micro_batch_size, "device": str(device),
               "threads": torch.get_num_threads(),
               "tokens_per_sec": results, "ratio": ratio}
    if args.torch_compile:
        figures["compiled_over_eager"] = results["megatron_lite_compiled"] / results["megatron_lite"]
        print(f"ratio compiled / eager megatron_lite: {figures['compiled_over_eager']:.3f}")
    figures["load_average_1_5_15min_at_start"] = load_at_start
    record_result("train_step", figures, sys.argv)


if __name__ == "__main__":
    main()
