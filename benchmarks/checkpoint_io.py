"""Checkpoint save/load throughput at DP2: sharded DCP (sync and async) vs a single-file torch.save baseline.

A ~100M-parameter Llama-style model (fp32, AdamW after one real training step) on two data-parallel CPU
ranks. Compared in the same run, on the same state (weights, fp32 masters, both Adam moments):

  dcp sync     Checkpointer.save_checkpoint: each rank writes its half of the deduplicated boxes in parallel
  dcp async    the same with --async-save: `blocked` is the time training waits (a CPU copy of what this
               rank writes, into buffers kept from the previous save: the first save also allocates
               them), `total` the time until the checkpoint is committed
  torch.save   rank 0 writes one file holding everything (the other rank waits), then fsync as DCP does
  load         Checkpointer.load_checkpoint vs every rank torch.load(weights_only=True) of the single file

MB/s = bytes on disk / seconds every rank is held up, best of two interleaved rounds (the async figure is
the second round's, with warm buffers; the first is reported too). Reads follow the writes, so they are
served from the page cache on both sides. Prints the ratios and appends the figures to
benchmarks/results/checkpoint_io.jsonl.

    python -m benchmarks.checkpoint_io [--layers 14] [--dir /tmp/checkpoint_io]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pretrain_gpt
from benchmarks.results_file import record_result
from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.checkpointing import Checkpointer, stored_bytes
from megatron_lite.checkpoint.planner import SafeFileSystemReader
from megatron_lite.config.arguments import make_config
from megatron_lite.model.sharding import FlatShard
from megatron_lite.training.loop import (
    build_data_iterator,
    build_datasets,
    initialize,
    setup_model_and_optimizer,
    train_step,
)

WORLD_SIZE = 2
ROUNDS = 2


def model_values(layers: int, root: str) -> dict:
    """Llama-style, hidden 768, SwiGLU 2048, vocab 8192 untied: 14 layers are 100.5M parameters."""
    return {"model_preset": "llama-tiny", "mock_data": True, "num_layers": layers, "hidden_size": 768,
            "ffn_hidden_size": 2048, "num_attention_heads": 12, "num_query_groups": 4, "vocab_size": 8192,
            "seq_length": 32, "max_position_embeddings": 32, "micro_batch_size": 1, "global_batch_size": 2,
            "train_iters": 1, "eval_interval": 1000, "log_interval": 1000, "device": "cpu",
            "save": f"{root}/dcp", "load": f"{root}/dcp"}


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _flat_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Everything a checkpoint holds, as the plain tensors a single-file torch.save would write."""
    state = {name: p.detach() for chunk in model for name, p in chunk.module.named_global_parameters()}
    for key, value in optimizer.sharded_state_dict().items():
        if isinstance(value, FlatShard):
            state[key] = value.data
    return state


def _torch_save(state: dict, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _torch_load_into(state: dict, path: str) -> None:
    loaded = torch.load(path, weights_only=True)
    with torch.no_grad():
        for key, tensor in state.items():
            tensor.copy_(loaded[key])


def _rank_main(rank: int, init_file: str, values: dict, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    config = make_config(values, WORLD_SIZE)
    pstate, device = initialize(config)
    model, optimizer = setup_model_and_optimizer(config, pstate, pretrain_gpt.model_provider, device)
    train_ds, _, _ = build_datasets(config)
    train_step(pretrain_gpt.forward_step, build_data_iterator(train_ds, config, pstate, 0), model, optimizer,
               config, pstate, 0, device)
    root = config.checkpoint.save
    figures = {"parameters": sum(p.numel() for chunk in model for p in chunk.module.parameters())}

    sync = Checkpointer(config, pstate, device)
    async_root = f"{root}_async"  # a directory of its own: one run (here one Checkpointer) per save directory
    async_config = dataclasses.replace(config, checkpoint=dataclasses.replace(
        config.checkpoint, async_save=True, save=async_root, load=async_root))
    background = Checkpointer(async_config, pstate, device)
    state = _flat_state(model, optimizer)
    single_file = f"{os.path.dirname(root)}/single_file.pt"
    times = defaultdict(list)
    for round_ in range(ROUNDS):  # interleaved, so that a slow moment of the shared disk hits both sides
        times["torch_save_s"].append(_timed(lambda: _torch_save(state, single_file) if rank == 0 else None))
        times["dcp_sync_save_s"].append(_timed(lambda i=10 * round_ + 1: sync.save_checkpoint(i, 2, model, optimizer)))
        dist.barrier()
        start = time.perf_counter()
        blocked = background.save_checkpoint(10 * round_ + 2, 2, model, optimizer)
        background.maybe_finalize_async_save(blocking=True)
        times["dcp_async_total_s"].append(_all_ranks_max(time.perf_counter() - start))
        times["dcp_async_blocked_s"].append(_all_ranks_max(blocked))
        times["torch_load_s"].append(_timed(lambda: _torch_load_into(state, single_file)))
        times["dcp_load_s"].append(_timed(lambda: sync.load_checkpoint(model, optimizer)))
    background.close()
    sync.close()
    figures.update({name: min(values) for name, values in times.items()})
    figures["dcp_async_blocked_s"] = times["dcp_async_blocked_s"][-1]
    figures["dcp_async_first_blocked_s"] = times["dcp_async_blocked_s"][0]
    figures["all_rounds"] = dict(times)
    figures["dcp_bytes"] = stored_bytes(SafeFileSystemReader(directory.checkpoint_path(async_root, 2)).read_metadata())
    figures["torch_save_bytes"] = os.path.getsize(single_file)
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def _all_ranks_max(value: float) -> float:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def report(f: dict) -> dict:
    mb = 1e6
    rates = {"dcp_sync_save_MBps": f["dcp_bytes"] / mb / f["dcp_sync_save_s"],
             "dcp_async_save_MBps_blocked": f["dcp_bytes"] / mb / f["dcp_async_blocked_s"],
             "dcp_async_save_MBps_total": f["dcp_bytes"] / mb / f["dcp_async_total_s"],
             "dcp_load_MBps": f["dcp_bytes"] / mb / f["dcp_load_s"],
             "torch_save_MBps": f["torch_save_bytes"] / mb / f["torch_save_s"],
             "torch_load_MBps": f["torch_save_bytes"] / mb / f["torch_load_s"]}
    ratios = {"save_sync_vs_torch_save": rates["dcp_sync_save_MBps"] / rates["torch_save_MBps"],
              "save_async_blocked_vs_torch_save": rates["dcp_async_save_MBps_blocked"] / rates["torch_save_MBps"],
              "load_vs_torch_load": rates["dcp_load_MBps"] / rates["torch_load_MBps"]}
    print(f"model: {f['parameters'] / 1e6:.1f}M parameters, DP{WORLD_SIZE}; checkpoint {f['dcp_bytes'] / mb:.0f} MB "
          f"(DCP), {f['torch_save_bytes'] / mb:.0f} MB (torch.save)")
    print(f"  save  dcp sync     {f['dcp_sync_save_s']:7.2f} s  {rates['dcp_sync_save_MBps']:8.0f} MB/s")
    print(f"  save  dcp async    {f['dcp_async_blocked_s']:7.2f} s blocked "
          f"({rates['dcp_async_save_MBps_blocked']:,.0f} MB/s), {f['dcp_async_total_s']:.2f} s until committed; "
          f"first save {f['dcp_async_first_blocked_s']:.2f} s blocked")
    print(f"  save  torch.save   {f['torch_save_s']:7.2f} s  {rates['torch_save_MBps']:8.0f} MB/s")
    print(f"  load  dcp          {f['dcp_load_s']:7.2f} s  {rates['dcp_load_MBps']:8.0f} MB/s")
    print(f"  load  torch.load   {f['torch_load_s']:7.2f} s  {rates['torch_load_MBps']:8.0f} MB/s")
    print("  ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return {**rates, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14, help="transformer layers (14: 100.5M parameters)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="checkpoint_io_")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    load_average = os.getloadavg()[0]  # other processes on the machine share the disk and the cores
    try:
        context = mp.get_context("spawn")
        results = context.SimpleQueue()
        init_file = os.path.join(root, "init")
        mp.start_processes(_rank_main, args=(init_file, model_values(args.layers, root), results),
                           nprocs=WORLD_SIZE, start_method="spawn")
        figures = results.get()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rates = report(figures)
    print(f"  load average during the run: {load_average:.1f} on {os.cpu_count()} cores")
    record_result("checkpoint_io", {"layers": args.layers, "world_size": WORLD_SIZE, **figures, **rates,
                                    "load_average_1min": load_average}, sys.argv)


if __name__ == "__main__":
    main()
