"""Start-up of one rank of a large model: elements drawn, seconds and host memory to build its model chunk and
optimizer, fresh and for a resume, against the old whole-tensor draw and an allocate-and-fill floor.

One rank (global rank 0: the first pipeline stage, TP rank 0, DP rank 0) of each layout below, built on the CPU
by `training.setup_model_and_optimizer` as a run builds it, bf16 weights with the distributed optimizer
(ZeRO-1, --data-parallel-sharding-strategy optim). The layout's process groups are stood in for: every group
is a token that answers its real size and this rank's place in it (so buckets are padded and sharded as at
that data-parallel size), and any collective raises, as none belongs in a build. A whole stage does not fit
this machine's shared 24 GiB with its gradients (a 70B TP8 PP4 rank holds 2.3B parameters), so each rank is
built with the real shapes but `--layers-per-stage` transformer layers (default 1) plus its stage's embedding,
and the whole stage's figures are the built ones scaled by elements (every cost here is per element).

Each measurement runs in a fresh process (its peak RSS is its own):
  build    a fresh run: parameters drawn (sharding.draw_normal_shard calls counted), masters, moments, grads
  resume   the same inside sharding.initialization_skipped(), as training.py builds for a --load resume
  floor    allocate the bytes the build holds (weights, fp32 grads, fp32 masters, two fp32 moments) and fill
           each once: what a build could at best cost
  old      the peer: the whole-tensor draw of cf9df03^ (a torch.Generator seeded per global name, normal_ over
           the global tensor, the TP shard cut out), for the same parameters; drawn in row blocks of 32M
           elements so that the 405B's 7 GB global tensors need not exist here (the same number of draws; the
           old code's peak, which held the whole global tensor, is given from its shape)

Second part, the checkpoint read: a small model saved at TP1 DP4 (whole tensors), TP4 (quarters) and TP1 DP4
ZeRO-1 (flat ranges) is loaded at TP2 PP2 on four gloo ranks; each rank counts the bytes DCP reads from the
files (each read item's stored chunk, which FileSystemReader loads whole and then narrows), the bytes its
read plan asks for, and the bytes of its own shard; the checksum pass before the load is counted apart.

    python -m benchmarks.startup [--layers-per-stage 1] [--cases llama3-70b,llama3.1-405b,qwen3-30b-a3b]
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import resource
import sys
import time

import torch
import torch.multiprocessing as mp

from benchmarks.results_file import record_result

# Layouts as they are run: Llama 3's paper trains 405B at TP8 PP16 on DP128 (16K GPUs); 70B at TP8 PP4 on DP64
# (2,048 GPUs) stands for a large job; Qwen3-30B-A3B as Megatron-Bridge's recipe, TP4 PP2 EP4, at DP4 (EP must
# divide DP here). The 405B's 126 layers split as Megatron-Bridge does: 7 on the first and last stage, 8 between.
CASES = {
    "llama3-70b": {"preset": "llama3-70b", "tp": 8, "pp": 4, "ep": 1, "dp": 64},
    "llama3.1-405b": {"preset": "llama3.1-405b", "tp": 8, "pp": 16, "ep": 1, "dp": 128,
                      "decoder_first_pipeline_num_layers": 7, "decoder_last_pipeline_num_layers": 7},
    "qwen3-30b-a3b": {"preset": "qwen3-30b-a3b", "tp": 4, "pp": 2, "ep": 4, "dp": 4},
}
ZERO = "optim"
OLD_BLOCK_ELEMENTS = 1 << 25


def run_values(case: dict, layers_per_stage: int | None) -> dict:
    """The flags of the case's run; with `layers_per_stage`, the real shapes with that many layers per stage."""
    values = {"model_preset": case["preset"], "mock_data": True, "tensor_model_parallel_size": case["tp"],
              "pipeline_model_parallel_size": case["pp"], "expert_model_parallel_size": case["ep"], "bf16": True,
              "data_parallel_sharding_strategy": ZERO, "micro_batch_size": 1, "global_batch_size": case["dp"],
              "seq_length": 4096, "train_iters": 1, "device": "cpu",
              "sequence_parallel": case["ep"] > 1}  # MoE with TP takes sequence parallelism
    if layers_per_stage is None:
        return {**values, **{k: v for k, v in case.items() if k.startswith("decoder_")}}
    return {**values, "num_layers": layers_per_stage * case["pp"]}


# ---------------------------------------------------------------------------------------------------------
# Process groups stood in for


class StoodInGroup:
    """What a `group=` argument is here: the real group's size and this rank's index in it."""

    def __init__(self, kind: str, members: list[int], rank: int):
        self.kind, self.size, self.rank, self.members = kind, len(members), members.index(rank), members


def stood_in_state(layout, rank: int):
    """A ParallelState of `layout` at `rank` whose groups are StoodInGroups (None where the group is one rank,
    as ParallelState.build leaves them)."""
    from megatron_lite.parallel.state import ParallelState, embedding_group_ranks, group_ranks

    class StoodInState(ParallelState):
        def group(self, kind: str):
            if kind in ("cp_a2a", "cp_p2p") and layout.hierarchical_cp is None:
                return None
            if kind == "world":
                members = list(range(layout.world_size))
            elif kind == "embedding":
                members = next(r for r in embedding_group_ranks(layout) if rank in r)
            else:
                members = next(r for r in group_ranks(layout, kind) if rank in r)
            return StoodInGroup(kind, members, rank) if len(members) > 1 else None

    base = ParallelState.without_groups(layout, rank)
    return StoodInState(layout, rank, {}, base.pp_ranks)


def _stand_in_for_torch_distributed() -> None:
    """torch.distributed answering sizes and ranks from StoodInGroups; a collective is an error."""
    import torch.distributed as dist

    def size(group=None):
        return group.size if isinstance(group, StoodInGroup) else 1

    def rank(group=None):
        return group.rank if isinstance(group, StoodInGroup) else 0

    def refuse(name):
        def call(*args, **kwargs):
            raise RuntimeError(f"dist.{name} called while building the model and optimizer")
        return call

    dist.get_world_size, dist.get_rank = size, rank
    dist.get_global_rank = lambda group, r: group.members[r]
    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "all_to_all_single", "barrier", "isend", "irecv", "send", "recv", "all_gather_object"):
        setattr(dist, name, refuse(name))


# ---------------------------------------------------------------------------------------------------------
# The measurements, each in its own process


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _built(case: dict, layers_per_stage: int, skip_draw: bool) -> dict:
    import pretrain_gpt
    from megatron_lite.config.arguments import make_config
    from megatron_lite.config.layer_split import pipeline_stage_layers
    from megatron_lite.model import sharding
    from megatron_lite.optim.builder import build_optimizer
    from megatron_lite.optim.param_and_grad_buffer import storage_bytes
    from megatron_lite.parallel.state import Layout
    from megatron_lite.training.loop import build_model, set_random_seed

    layout = Layout(tp=case["tp"], pp=case["pp"], dp=case["dp"], ep=case["ep"])
    config = make_config(run_values(case, layers_per_stage), layout.world_size)
    stage_layers = pipeline_stage_layers(make_config(run_values(case, None), layout.world_size))[0]
    _stand_in_for_torch_distributed()
    pstate = stood_in_state(layout, 0)
    set_random_seed(config.training.seed, pstate.pp_rank)
    rss_before = _rss_bytes()
    start = time.perf_counter()
    with sharding.initialization_skipped(skip_draw), sharding.recorded_draws() as draws:
        model = build_model(config, pstate, pretrain_gpt.model_provider, torch.device("cpu"))
        model_s = time.perf_counter() - start
        optimizer = build_optimizer(config, model, pstate)
    total_s = time.perf_counter() - start
    peak = _peak_rss_bytes()
    named = [(name, p) for chunk in model for name, p in chunk.module.named_global_parameters()]
    params = [p for _, p in named]
    random = [(name, p) for name, p in named if p.spec.init in ("normal", "scaled_normal")]
    layer_elements = sum(p.numel() for name, p in named if ".layers." in name)
    footprint = optimizer.memory_footprint()
    return {"model_s": model_s, "model_and_optimizer_s": total_s,
            "drawn_elements": sum(elements for _, elements in draws), "draw_calls": len(draws),
            "shard_elements": sum(p.numel() for p in params),
            "random_shard_elements": sum(p.numel() for _, p in random),
            "layer_elements": layer_elements, "built_layers": layers_per_stage, "stage_layers": stage_layers,
            "bytes": {"weights": storage_bytes(params), "grads": storage_bytes([p.main_grad for p in params]),
                      "masters": footprint["master"], "moments": footprint["moments"]},
            "rss_before_build": rss_before, "peak_rss": peak,
            "random_specs": [(name, p.spec, pstate.tp_rank, pstate.tp_size, config.model.init_method_std,
                              config.model.num_layers, config.training.seed) for name, p in random]}


def measure_build(case: dict, layers_per_stage: int) -> dict:
    figures = _built(case, layers_per_stage, skip_draw=False)
    figures.pop("random_specs")
    return figures


def measure_resume(case: dict, layers_per_stage: int) -> dict:
    return _built(case, layers_per_stage, skip_draw=True)


def measure_floor(held_bytes: dict) -> dict:
    """Allocate each kind of state the build holds and fill it once."""
    rss_before = _rss_bytes()
    start = time.perf_counter()
    kept = []
    for kind, nbytes in held_bytes.items():
        dtype = torch.bfloat16 if kind == "weights" else torch.float32
        kept.append(torch.empty(nbytes // dtype.itemsize, dtype=dtype).fill_(1.0))
    return {"seconds": time.perf_counter() - start, "rss_before_build": rss_before, "peak_rss": _peak_rss_bytes()}


def _old_name_seed(seed: int, global_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _old_draw(name, spec, tp_rank, tp_size, std, num_layers, seed) -> int:
    """One parameter as cf9df03^ initialized it: the global tensor's real rows drawn by a generator seeded from
    the global name, this rank's shard kept; row block by row block. Returns the elements drawn."""
    from megatron_lite.model.sharding import new_parameter, shard_indices

    scale = std if spec.init == "normal" else std / math.sqrt(2.0 * num_layers)
    generator = torch.Generator().manual_seed(_old_name_seed(seed, name))
    local = new_parameter(spec, tp_size).data
    indices = shard_indices(spec, tp_rank, tp_size)
    rows = spec.global_shape[0] if spec.valid_rows is None else spec.valid_rows
    row_elements = math.prod(spec.global_shape[1:])
    per_block = max(1, OLD_BLOCK_ELEMENTS // row_elements)
    for first in range(0, rows, per_block):
        block = torch.empty(min(per_block, rows - first), *spec.global_shape[1:]).normal_(0.0, scale,
                                                                                           generator=generator)
        wanted = (indices[0] >= first) & (indices[0] < first + block.shape[0])
        piece = block[indices[0][wanted] - first]
        for d in range(1, len(spec.global_shape)):
            piece = piece.index_select(d, indices[d])
        local[wanted] = piece
    return rows * row_elements


def measure_old(random_specs: list) -> dict:
    start = time.perf_counter()
    drawn = sum(_old_draw(*entry) for entry in random_specs)
    largest = max(math.prod(entry[1].global_shape) for entry in random_specs)
    return {"seconds": time.perf_counter() - start, "drawn_elements": drawn, "largest_global_tensor_bytes": 4 * largest}


def _in_process(target, results, *args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    results.put(target(*args))


def in_fresh_process(target, *args) -> dict:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    process = context.Process(target=_in_process, args=(target, results, *args))
    process.start()
    figures = results.get()
    process.join()
    return figures


def measure_case(case: dict, layers_per_stage: int) -> dict:
    resume = in_fresh_process(measure_resume, case, layers_per_stage)
    specs = resume.pop("random_specs")
    build = in_fresh_process(measure_build, case, layers_per_stage)
    floor = in_fresh_process(measure_floor, build["bytes"])
    old = in_fresh_process(measure_old, specs)
    return {"layout": case, "zero": ZERO, "build": build, "resume": resume, "floor": floor, "old": old}


# ---------------------------------------------------------------------------------------------------------
# What a load reads


READ_MODEL = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 4, "hidden_size": 256,
              "ffn_hidden_size": 512, "num_attention_heads": 8, "num_query_groups": 4, "vocab_size": 2048,
              "seq_length": 32, "max_position_embeddings": 32, "micro_batch_size": 1, "global_batch_size": 4,
              "train_iters": 1, "device": "cpu"}
READ_WORLD = 4
SAVED_AT = {"TP1 DP4": {}, "TP4": {"tensor_model_parallel_size": 4},
            "TP1 DP4 ZeRO-1": {"data_parallel_sharding_strategy": "optim"}}
LOADED_AT = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}


class ReadCounter:
    """Bytes a load reads, counted in SafeFileSystemReader.read_data (each read item's stored chunk, which DCP
    loads whole before narrowing it, and the part its plan asks for) and in the checksum pass."""

    def __init__(self):
        from megatron_lite.checkpoint import checksums
        from megatron_lite.checkpoint.planner import SafeFileSystemReader

        self.stored = self.requested = self.items = self.verified = 0
        read_data, file_record = SafeFileSystemReader.read_data, checksums.file_record
        counter = self

        def counting_read_data(reader, plan, planner):
            for item in plan.items:
                counter.items += 1
                counter.stored += reader.storage_data[item.storage_index].length
                dtype = planner.metadata.state_dict_metadata[item.dest_index.fqn].properties.dtype
                counter.requested += math.prod(item.lengths) * dtype.itemsize
            return read_data(reader, plan, planner)

        def counting_file_record(path):
            record = file_record(path)
            counter.verified += record["bytes"]
            return record

        SafeFileSystemReader.read_data = counting_read_data
        checksums.file_record = counting_file_record

    def reset(self) -> None:
        self.stored = self.requested = self.items = self.verified = 0


def _read_rank(rank: int, init_file: str, root: str, results) -> None:
    import torch.distributed as dist

    import pretrain_gpt
    from megatron_lite.checkpoint.checkpointing import Checkpointer
    from megatron_lite.config.arguments import make_config
    from megatron_lite.model.sharding import FlatShard, initialization_skipped
    from megatron_lite.training.loop import initialize, setup_model_and_optimizer

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=READ_WORLD)
    counter = ReadCounter()
    figures = {}
    for name, flags in SAVED_AT.items():
        save = os.path.join(root, name.replace(" ", "_"))
        config = make_config({**READ_MODEL, **flags, "save": save}, READ_WORLD)
        pstate, device = initialize(config)
        model, optimizer = setup_model_and_optimizer(config, pstate, pretrain_gpt.model_provider, device)
        saver = Checkpointer(config, pstate, device)
        saver.save_checkpoint(1, 4, model, optimizer)
        saver.close()
        config = make_config({**READ_MODEL, **LOADED_AT, "load": save}, READ_WORLD)
        pstate, device = initialize(config)
        with initialization_skipped():
            model, optimizer = setup_model_and_optimizer(config, pstate, pretrain_gpt.model_provider, device)
        loader = Checkpointer(config, pstate, device)
        counter.reset()
        loader.load_checkpoint(model, optimizer)
        loader.close()
        params = [p for chunk in model for p in chunk.module.parameters()]
        states = [v.data for v in optimizer.sharded_state_dict().values() if isinstance(v, FlatShard)]
        shard = sum(t.numel() * t.element_size() for t in params + states)
        mine = {"shard_bytes": shard, "plan_bytes": counter.requested, "stored_chunk_bytes_read": counter.stored,
                "read_items": counter.items, "checksum_bytes_read": counter.verified}
        everyone = [None] * READ_WORLD
        dist.all_gather_object(everyone, mine)
        figures[name] = everyone
        dist.barrier()
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def measure_reads() -> dict:
    """Per save layout, every rank's read figures when loading at TP2 PP2."""
    import tempfile

    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="startup_reads_") as root:
        mp.start_processes(_read_rank, args=(os.path.join(root, "init"), root, results), nprocs=READ_WORLD,
                           start_method="spawn")  # raises a rank's exception; rank 0's figures fit the pipe
        return results.get()


# ---------------------------------------------------------------------------------------------------------
# Report


def _above_start(run: dict) -> float:
    return (run["peak_rss"] - run["rss_before_build"]) / 2**30


def report_case(name: str, f: dict) -> dict:
    b, r, floor, old, layout = f["build"], f["resume"], f["floor"], f["old"], f["layout"]
    held = sum(b["bytes"].values())
    per_layer = b["layer_elements"] / b["built_layers"]
    stage_elements = b["shard_elements"] - b["layer_elements"] + per_layer * b["stage_layers"]
    scale = stage_elements / b["shard_elements"]
    old_build_s = r["model_and_optimizer_s"] + old["seconds"]  # the build less its draw, plus the old draw
    derived = {
        "drawn_over_random_shard": b["drawn_elements"] / b["random_shard_elements"],
        "old_drawn_over_random_shard": old["drawn_elements"] / b["random_shard_elements"],
        "build_over_floor": b["model_and_optimizer_s"] / floor["seconds"],
        "resume_over_floor": r["model_and_optimizer_s"] / floor["seconds"],
        "old_build_over_build": old_build_s / b["model_and_optimizer_s"],
        "old_build_s": old_build_s, "stage_elements": stage_elements, "stage_scale": scale,
        "stage_build_s": b["model_and_optimizer_s"] * scale, "stage_resume_s": r["model_and_optimizer_s"] * scale,
        "stage_floor_s": floor["seconds"] * scale, "stage_old_build_s": old_build_s * scale,
        "stage_held_GiB": held * scale / 2**30,
    }
    ep = f", EP{layout['ep']}" if layout["ep"] > 1 else ""
    print(f"{name}: rank 0 of TP{layout['tp']} PP{layout['pp']}{ep}, DP{layout['dp']} stood in, bf16, ZeRO-1 "
          f"({f['zero']}); built: stage 0's embedding + {b['built_layers']} of its {b['stage_layers']} layers, "
          f"real shapes: {b['shard_elements'] / 1e6:,.1f}M elements ({held / 2**30:.2f} GiB held: "
          + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in b["bytes"].items()) + ")")
    print(f"  elements drawn   new {b['drawn_elements'] / 1e6:9,.1f}M = {derived['drawn_over_random_shard']:.3f} x "
          f"the randomly initialized shard ({b['random_shard_elements'] / 1e6:,.1f}M); old "
          f"{old['drawn_elements'] / 1e6:,.1f}M ({derived['old_drawn_over_random_shard']:.2f} x); resume "
          f"{r['drawn_elements']}")
    print(f"  seconds          build {b['model_and_optimizer_s']:7.2f} (model {b['model_s']:.2f})   resume "
          f"{r['model_and_optimizer_s']:6.2f}   allocate+fill floor {floor['seconds']:6.2f}   old draw "
          f"{old['seconds']:6.2f} (old build {old_build_s:.2f})")
    print(f"  ratios           build/floor {derived['build_over_floor']:.1f}x (target <= 2), resume/floor "
          f"{derived['resume_over_floor']:.1f}x, old build/build {derived['old_build_over_build']:.2f}x")
    print(f"  host peak        build +{_above_start(b):.2f} GiB, resume +{_above_start(r):.2f}, floor "
          f"+{_above_start(floor):.2f} over the process before building; the old draw held a "
          f"{old['largest_global_tensor_bytes'] / 2**30:.2f} GiB global tensor on top")
    print(f"  whole stage      {stage_elements / 1e9:.2f}B elements ({scale:.1f} x built), scaled by elements: "
          f"build {derived['stage_build_s']:.0f} s, resume {derived['stage_resume_s']:.0f} s, floor "
          f"{derived['stage_floor_s']:.0f} s, old {derived['stage_old_build_s']:.0f} s; "
          f"{derived['stage_held_GiB']:.1f} GiB held")
    return derived


def report_reads(reads: dict) -> dict:
    print(f"checkpoint read at TP2 PP2 ({READ_WORLD} ranks), per rank: shard / plan / stored chunks read "
          "(MB), checksum pass (MB)")
    summary = {}
    for saved, ranks in reads.items():
        over = [r["stored_chunk_bytes_read"] / r["shard_bytes"] for r in ranks]
        summary[saved] = {"max_read_over_shard": max(over),
                          "plan_equals_shard": all(r["plan_bytes"] == r["shard_bytes"] for r in ranks)}
        print(f"  saved at {saved:15s} " + "  ".join(
            f"r{i} {r['shard_bytes'] / 1e6:.1f}/{r['plan_bytes'] / 1e6:.1f}/{r['stored_chunk_bytes_read'] / 1e6:.1f}"
            f"/{r['checksum_bytes_read'] / 1e6:.1f}" for i, r in enumerate(ranks))
            + f"   read/shard up to {max(over):.2f}x")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers-per-stage", type=int, default=1, help="transformer layers built per stage")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--skip-reads", action="store_true", help="leave out the checkpoint-read part")
    args = parser.parse_args()
    load_average = os.getloadavg()
    figures = {"layers_per_stage": args.layers_per_stage, "cases": {}, "derived": {}}
    for name in args.cases.split(","):
        figures["cases"][name] = measure_case(CASES[name], args.layers_per_stage)
        figures["derived"][name] = report_case(name, figures["cases"][name])
    if not args.skip_reads:
        figures["reads"] = measure_reads()
        figures["reads_summary"] = report_reads(figures["reads"])
    figures["load_average"] = {"start": load_average, "end": os.getloadavg()}
    print(f"load average (1, 5, 15 min): {load_average[0]:.1f} {load_average[1]:.1f} {load_average[2]:.1f} at the "
          f"start, {figures['load_average']['end'][0]:.1f} at the end, on {os.cpu_count()} cores")
    record_result("startup", figures, sys.argv)


if __name__ == "__main__":
    main()
