"""MoE throughput, host reads and expert-parallel traffic: MoE models vs dense models with the same active parameters.

The dense peer has one SwiGLU MLP of ffn = k x moe-ffn-hidden-size per layer, so a token meets as many
weights in it as in its k experts (the router's E x h weights aside): the ratio of tokens/s is the price of
routing, permutation and the grouped expert GEMMs. On one process: mixtral-tiny (8 experts, top-2) and a
fine-grained MoE of 16 experts, top-4, each a quarter of mixtral-tiny's expert width (DeepSeek / Qwen3-MoE
style), each against its dense peer; and the host reads of values of device tensors (`.item()`, `.tolist()`,
...; each a synchronisation on a GPU, counted on the CPU by megatron_lite/training/host_reads.py) in one training step,
against the dense peer's, which reads once (the loss and gradient norm); and the fine-grained experts' compute
alone through each kernel (grouped GEMM, padded bmm, a matmul per expert). Then, on 2 gloo ranks (DP 2):
mixtral-tiny with EP 2 (alltoall and allgather dispatchers) and EP 1 (every expert on every rank), and the
dense peer; for each, tokens/s, host reads per step, and the bytes each rank sends to the other per training
step through the expert-parallel collectives, counted at parallel/mappings.py, next to the expected alltoall
volume
2 (dispatch + combine) x 2 (forward + backward) x L_moe x T k h x 4 bytes x (ep - 1) / ep.
Full training steps (forward, backward, gradient reduction, AdamW) through training.pretrain, timed from
the per-iteration metrics after 2 warm-up steps. The configurations run in turn, --rounds times, and each
figure is the median over all their timed steps, so that a change in the machine's load (recorded too)
hits every configuration alike. Prints the figures and ratios, and appends them with date, machine and
command to benchmarks/results/moe.jsonl.

    python -m benchmarks.moe [--steps 4] [--rounds 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_pattern import moe_layer_pattern
from megatron_lite.model.moe import experts as moe_experts
from megatron_lite.parallel import mappings
from megatron_lite.training import loop as training
from megatron_lite.training.host_reads import counted_device_reads

WARMUP = 2
RUN = {"model_preset": "mixtral-tiny", "mock_data": True, "micro_batch_size": 4, "eval_interval": 10_000,
       "log_interval": 10_000, "lr": 1e-3}

# 16 experts of a quarter of mixtral-tiny's width (256 / 4), 4 per token: the active width of mixtral-tiny's 8 x top-2
FINE_GRAINED = {"num_experts": 16, "moe_router_topk": 4, "moe_ffn_hidden_size": 64}


def dense_peer(values: dict) -> dict:
    """The same model with one dense MLP as wide as the k experts a token visits."""
    m = make_config(values).model
    return {**values, "num_experts": None, "moe_aux_loss_coeff": 0.0,
            "ffn_hidden_size": m.moe_router_topk * m.moe_ffn_hidden_size}


class TrafficCounter:
    """Bytes this rank sends to other ranks through the collectives MoE uses (all-to-all with splits,
    dim-0 all-gather and reduce-scatter), counted by wrapping the plain collectives of parallel/mappings."""

    def __init__(self):
        self.bytes_sent = 0
        self._originals = {}

    def __enter__(self):
        def all_to_all_single(tensor, group, output_splits=None, input_splits=None):
            if group is not None:
                rows = tensor.shape[0]
                splits = input_splits or [rows // dist.get_world_size(group)] * dist.get_world_size(group)
                remote = rows - splits[dist.get_rank(group)]
                self.bytes_sent += remote * tensor[:1].numel() * tensor.element_size()
            return self._originals["all_to_all_single"](tensor, group, output_splits, input_splits)

        def all_gather_dim0(tensor, group):
            if group is not None:  # this rank's rows go to every other rank
                self.bytes_sent += (dist.get_world_size(group) - 1) * tensor.numel() * tensor.element_size()
            return self._originals["all_gather_dim0"](tensor, group)

        def reduce_scatter_dim0(tensor, group):
            if group is not None:  # every slice but this rank's own goes to its owner
                size = dist.get_world_size(group)
                self.bytes_sent += (size - 1) * tensor.numel() // size * tensor.element_size()
            return self._originals["reduce_scatter_dim0"](tensor, group)

        for fn in (all_to_all_single, all_gather_dim0, reduce_scatter_dim0):
            self._originals[fn.__name__] = getattr(mappings, fn.__name__)
            setattr(mappings, fn.__name__, fn)
        return self

    def __exit__(self, *exc):
        for name, fn in self._originals.items():
            setattr(mappings, name, fn)


def measure(values: dict, world_size: int, steps: int) -> tuple[list[float], float]:
    """tokens/s of each step after warm-up (on the logging rank; none elsewhere), and the bytes this rank
    sent per step through the MoE collectives."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metrics.jsonl")
        config = make_config({**values, "train_iters": WARMUP + steps, "metrics_jsonl": path}, world_size)
        with TrafficCounter() as counter:
            training.pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
        records = []
        if os.path.exists(path):  # written by the logging rank
            with open(path) as f:
                records = [json.loads(line) for line in f]
    return [r["tokens_per_sec"] for r in records][WARMUP:], counter.bytes_sent / (WARMUP + steps)


def host_reads_per_step(values: dict, world_size: int) -> int:
    """Reads of device values by the host in one training step (the second: the first warms up)."""
    config = make_config({**values, "train_iters": 2}, world_size)
    pstate, device = training.initialize(config)
    model, optimizer = training.setup_model_and_optimizer(config, pstate, pretrain_gpt.model_provider, device)
    iterator = training.build_data_iterator(training.build_datasets(config)[0], config, pstate, 0)
    training.train_step(pretrain_gpt.forward_step, iterator, model, optimizer, config, pstate, 0, device)
    batches = [next(iterator) for _ in range(config.num_microbatches)]
    reads: list[str] = []
    with counted_device_reads(reads, [state["step"] for adam in optimizer.adams for state in adam.state.values()]):
        training.train_step(pretrain_gpt.forward_step, iter(batches), model, optimizer, config, pstate, 1, device)
    return len(reads)


def measure_in_rounds(runs: dict, world_size: int, steps: int, rounds: int) -> dict:
    """Each configuration `rounds` times, interleaved: median tokens/s and bytes sent per step."""
    speeds, traffic = {name: [] for name in runs}, {}
    for _ in range(rounds):
        for name, values in runs.items():
            step_speeds, traffic[name] = measure(values, world_size, steps)
            speeds[name] += step_speeds
    return {name: {"tokens_per_sec": statistics.median(speeds[name]) if speeds[name] else None,
                   "bytes_sent_per_step": traffic[name]} for name in runs}


def _rank_main(rank: int, world_size: int, init_file: str, runs: dict, steps: int, rounds: int,
               out_file: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    results = measure_in_rounds(runs, world_size, steps, rounds)
    for name, values in runs.items():
        results[name]["host_reads_per_step"] = host_reads_per_step(values, world_size)
    if rank == world_size - 1:  # the logging rank
        with open(out_file, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run_on_two_ranks(runs: dict, steps: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "results.json")
        mp.spawn(_rank_main, args=(2, os.path.join(tmp, "init"), runs, steps, rounds, out_file), nprocs=2)
        with open(out_file) as f:
            return json.load(f)


def expected_alltoall_bytes(config_values: dict, ep: int) -> float:
    """Forward and backward, dispatch and combine, of every MoE layer of every micro-batch of a step."""
    m = make_config(config_values, 2).model
    moe_layers = sum(moe_layer_pattern(m))
    tokens = config_values["global_batch_size"] // 2 * m.seq_length  # this rank's tokens per step
    return 2 * 2 * moe_layers * tokens * m.moe_router_topk * m.hidden_size * 4 * (ep - 1) / ep


def expert_kernels_ms(device: str, repeats: int = 20) -> dict:
    """Forward + backward of the fine-grained MoE's experts on one micro-batch (micro-batch x seq x k rows,
    spread over 16 experts by a random routing), fc1 and fc2, in ms (median): torch._grouped_mm, the
    padded bmm, and one matmul per expert (what the layer did before the grouped GEMM)."""
    m = make_config({**RUN, **FINE_GRAINED}).model
    generator = torch.Generator().manual_seed(0)
    rows = RUN["micro_batch_size"] * m.seq_length * m.moe_router_topk
    experts = torch.randint(0, m.num_experts, (rows,), generator=generator).sort().values
    counts = torch.bincount(experts, minlength=m.num_experts).to(device)
    x = torch.randn(rows, m.hidden_size, generator=generator).to(device).requires_grad_()
    fc1 = [torch.randn(2 * m.moe_ffn_hidden_size, m.hidden_size, generator=generator).to(device).requires_grad_()
           for _ in range(m.num_experts)]
    fc2 = [torch.randn(m.hidden_size, m.moe_ffn_hidden_size, generator=generator).to(device).requires_grad_()
           for _ in range(m.num_experts)]

    def loop(inputs, weights, _):
        return torch.cat([chunk @ w.t() for chunk, w in zip(inputs.split(counts.tolist()), weights)])

    kernels = {"padded_bmm": partial(moe_experts.experts_linear, grouped_mm=False), "per_expert_loop": loop}
    if moe_experts.grouped_mm_applies(x, fc1[0]):
        kernels = {"grouped_mm": partial(moe_experts.experts_linear, grouped_mm=True), **kernels}
    times = {}
    for name, linear in kernels.items():
        samples = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            linear(torch.nn.functional.silu(linear(x, fc1, counts)[:, :m.moe_ffn_hidden_size]), fc2,
                   counts).square().sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        times[name] = 1000 * statistics.median(samples[2:])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    single = {**RUN, "global_batch_size": 8, "device": args.device}
    fine = {**single, **FINE_GRAINED}
    one_runs = {"mixtral_tiny": single, "dense": dense_peer(single), "fine_grained_16x_top4": fine,
                "fine_grained_dense_peer": dense_peer(fine)}
    one = measure_in_rounds(one_runs, 1, args.steps, args.rounds)
    for name, values in one_runs.items():
        one[name]["host_reads_per_step"] = host_reads_per_step(values, 1)
    one_ratio = one["mixtral_tiny"]["tokens_per_sec"] / one["dense"]["tokens_per_sec"]
    fine_ratio = one["fine_grained_16x_top4"]["tokens_per_sec"] / one["fine_grained_dense_peer"]["tokens_per_sec"]
    for moe, dense, ratio in (("mixtral_tiny", "dense", one_ratio),
                              ("fine_grained_16x_top4", "fine_grained_dense_peer", fine_ratio)):
        print(f"1 process   {moe} {one[moe]['tokens_per_sec']:,.0f} tokens/s, {one[moe]['host_reads_per_step']} "
              f"host reads/step | dense peer {one[dense]['tokens_per_sec']:,.0f} tokens/s, "
              f"{one[dense]['host_reads_per_step']} host reads/step | ratio MoE / dense {ratio:.3f}")

    kernels = expert_kernels_ms("cuda" if args.device == "cuda" else "cpu")
    print("fine-grained experts, forward + backward of one micro-batch: "
          + ", ".join(f"{name} {ms:.2f} ms" for name, ms in kernels.items()))

    two = {**RUN, "global_batch_size": 16, "device": "cpu"}
    runs = {"ep2_alltoall": {**two, "expert_model_parallel_size": 2},
            "ep2_allgather": {**two, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": "allgather"},
            "ep1": two, "dense": dense_peer(two)}
    ranks = run_on_two_ranks(runs, args.steps, args.rounds)
    expected = expected_alltoall_bytes(runs["ep2_alltoall"], 2)
    for name, figures in ranks.items():
        figures["ratio_over_dense"] = figures["tokens_per_sec"] / ranks["dense"]["tokens_per_sec"]
        print(f"2 ranks     {name:>14}: {figures['tokens_per_sec']:,.0f} tokens/s ({figures['ratio_over_dense']:.3f} "
              f"x dense), {figures['bytes_sent_per_step'] / 2**20:.2f} MiB sent per step per rank by MoE collectives, "
              f"{figures['host_reads_per_step']} host reads/step")
    print(f"expected alltoall volume per step per rank: {expected / 2**20:.2f} MiB")
    load = [load_before, os.getloadavg()[0]]
    print(f"load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores")
    record_result("moe", {
        "steps": args.steps, "rounds": args.rounds, "device": args.device, "micro_batch_size": RUN["micro_batch_size"],
        "load_average_before_after": load,
        "one_process": {"global_batch_size": 8, **one, "ratio_moe_over_dense": one_ratio,
                        "fine_grained": FINE_GRAINED, "ratio_fine_grained_over_dense": fine_ratio,
                        "fine_grained_expert_kernels_ms": kernels},
        "two_ranks": {"global_batch_size": 16, **ranks, "expected_alltoall_bytes_per_step": expected},
    }, sys.argv)


if __name__ == "__main__":
    main()
