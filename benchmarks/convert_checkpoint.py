"""Peak host memory and time of tools/convert_checkpoint.py, both ways, for a Llama-3.2-1B- or Llama-3-8B-shaped model.

The conversion streams a layer at a time, so its memory should follow the largest layer, not the model. This
measures it on a random bf16 Llama of the real shape (plain RoPE: the scaling changes no tensor):

  1b   Llama-3.2-1B: hidden 2048, 16 layers, 32 heads / 8 KV heads, SwiGLU 8192, vocabulary 128256, tied (2.5 GB)
  8b   Llama-3-8B:   hidden 4096, 32 layers, 32 heads / 8 KV heads, SwiGLU 14336, vocabulary 128256, untied (16 GB)

The model is generated without ever being whole in memory: config.json from transformers' LlamaConfig, then
the tensors in save_pretrained's order and names, one 5 GB shard at a time (save_pretrained's default shard
size), each written by safetensors' own save_file and freed (values: a 64 MB pool of random finite bf16 bit
patterns, read from a random offset per tensor; drawing 8B values would cost more than all else here).
Then, each a fresh process as a user would run it, its peak RSS taken from the kernel (os.wait4's
ru_maxrss of that child alone):

  copy          the peer: every shard read with safetensors.load_file and written with save_file, the least
                any conversion between two files has to do, holding a shard at a time
  hf-to-mlite   tools/convert_checkpoint.py: read the safetensors, fuse QKV and [gate; up], write the checkpoint
  mlite-to-hf   tools/convert_checkpoint.py: read the checkpoint, split, write 5 GB safetensors shards

and the round trip is checked tensor for tensor (bit patterns, shard by shard). The bound each peak is held
to, and which the result line records, is

  2 x max(largest decoder layer's tensors, largest single tensor outside the layers) + 512 MiB

(for both shapes the largest is the 128256-row embedding or output table); the fixed 512 MiB is the
interpreter with torch and the tool's imports (imports_peak_rss_bytes, measured too: a process importing just
them, about 300 MB) and I/O buffers. Appends one line per run to benchmarks/results/convert_checkpoint.jsonl
with the peaks, the bound, seconds and GB/s (safetensors bytes over wall seconds of the fresh process; the
tool's own "done in" counts from once its flags are read, torch's import included), and deletes the
generated files.

    python -m benchmarks.convert_checkpoint [--shape 1b|8b] [--layers N] [--dir /tmp/convert_benchmark]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import torch

from benchmarks.results_file import record_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},
}
FIXED_BUFFER = 512 << 20
SHARD_BYTES = 5 * 10**9  # save_pretrained's and the tool's default max shard size
# Runs a command and writes its peak RSS to a file. A child's ru_maxrss starts at its parent's RSS when it
# forks (exec keeps the high-water mark of the memory it replaces), so the command is started from this small
# process rather than from the benchmark, which holds the generated shard.
LAUNCH = """
import json, os, subprocess, sys
process = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(process.pid, 0)
with open(sys.argv[1], "w") as f:
    json.dump({"returncode": os.waitstatus_to_exitcode(status), "peak_rss_bytes": usage.ru_maxrss * 1024}, f)
"""
IMPORTS = "import torch.distributed.checkpoint, megatron_lite.hf.checkpoint, megatron_lite.hf.weights, " \
          "megatron_lite.hf.safetensors_files, megatron_lite.config.arguments, tqdm, yaml"
COPY = """
import glob, os, sys
from safetensors.torch import load_file, save_file
source, target = sys.argv[1:]
os.makedirs(target)
for path in sorted(glob.glob(os.path.join(source, "*.safetensors"))):
    save_file(load_file(path), os.path.join(target, os.path.basename(path)), metadata={"format": "pt"})
"""


def hf_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """A Llama's tensors in save_pretrained's order, with their shapes."""
    h, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    q, kv, ffn = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim, c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update({layer + "input_layernorm.weight": (h,), layer + "self_attn.q_proj.weight": (q, h),
                       layer + "self_attn.k_proj.weight": (kv, h), layer + "self_attn.v_proj.weight": (kv, h),
                       layer + "self_attn.o_proj.weight": (h, q), layer + "post_attention_layernorm.weight": (h,),
                       layer + "mlp.gate_proj.weight": (ffn, h), layer + "mlp.up_proj.weight": (ffn, h),
                       layer + "mlp.down_proj.weight": (h, ffn)})
    shapes["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def largest_unit_bytes(shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """Bytes (bf16) of the largest decoder layer's tensors together, and of the largest tensor outside them."""
    layers, other = {}, 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if name.startswith("model.layers."):
            layers[name.split(".")[2]] = layers.get(name.split(".")[2], 0) + nbytes
        else:
            other = max(other, nbytes)
    return max(layers.values()), other


def generate(c: dict, folder: str) -> int:
    """Write a random bf16 Llama of config `c` as save_pretrained would, a shard at a time; returns its bytes."""
    import transformers
    from safetensors.torch import save_file

    os.makedirs(folder)
    transformers.LlamaConfig(**c, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                             bos_token_id=128000, eos_token_id=128001, dtype="bfloat16").save_pretrained(folder)
    generator = torch.Generator().manual_seed(0)
    pool = torch.randint(-2**15, 2**15, (1 << 25,), dtype=torch.int16, generator=generator)
    pool &= ~0x4000  # exponent below 128: finite values of magnitude under 2
    shapes = hf_tensors(c)
    shards, size = [[]], 0
    for name, shape in shapes.items():  # the tool's (and save_pretrained's) plan: in order, cut at 5 GB
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = ["model.safetensors"] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                             for i in range(len(shards))]
    for file, shard in zip(files, shards):
        tensors = {}
        for name in shard:
            numel = torch.Size(shapes[name]).numel()
            start = int(torch.randint(0, pool.numel(), (1,), generator=generator))
            bits = pool.roll(-start).repeat(-(-numel // pool.numel()))[:numel]
            tensors[name] = bits.view(torch.bfloat16).view(shapes[name])
        save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
        del tensors
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return total


def measured(command: list[str], folder: str) -> dict:
    """Wall seconds and peak RSS (bytes: the kernel's ru_maxrss of that process alone) of a fresh process
    running `command`, and the seconds the tool reports ("done in") when it does."""
    report = os.path.join(folder, "rusage.json")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", LAUNCH, report, *command], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    with open(report) as f:
        usage = json.load(f)
    os.remove(report)
    if usage["returncode"]:
        raise RuntimeError(f"{' '.join(command)} failed ({usage['returncode']}):\n{result.stderr[-3000:]}")
    reported = re.search(r"done in ([0-9.]+) s", result.stderr)
    return {"seconds": round(wall, 2), "peak_rss_bytes": usage["peak_rss_bytes"],
            "tool_done_in_seconds": float(reported.group(1)) if reported else None}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def identical(first: str, second: str) -> bool:
    """Whether two HF directories hold the same tensors, bit for bit, compared a shard of `first` at a time."""
    from safetensors import safe_open

    def weight_map(folder):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                return json.load(f)["weight_map"]
        with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
            return dict.fromkeys(f.keys(), "model.safetensors")

    theirs = weight_map(second)
    if sorted(theirs) != sorted(weight_map(first)):
        return False
    for path in sorted(glob.glob(os.path.join(first, "*.safetensors"))):
        handles = {}
        with safe_open(path, framework="pt") as ours:
            names = ours.keys()
            for name in names:
                file = theirs[name]
                if file not in handles:
                    handles[file] = safe_open(os.path.join(second, file), framework="pt")
                if not same_bits(ours.get_tensor(name), handles[file].get_tensor(name)):
                    return False
        del handles  # unmapped before the next shard
    return True


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--layers", type=int, help="fewer layers than the shape's, for a quick run")
    parser.add_argument("--dir", default="/tmp/convert_benchmark")
    parser.add_argument("--no-record", action="store_true", help="print the figures only (a trial run)")
    args = parser.parse_args(argv[1:])
    c = dict(SHAPES[args.shape])
    if args.layers:
        c["num_hidden_layers"] = args.layers
    shutil.rmtree(args.dir, ignore_errors=True)
    hf, mlite, back, copy = (os.path.join(args.dir, name) for name in ("hf", "mlite", "back", "copy"))
    try:
        start = time.perf_counter()
        size = generate(c, hf)
        generate_seconds = time.perf_counter() - start
        layer_bytes, other_bytes = largest_unit_bytes(hf_tensors(c))
        bound = 2 * max(layer_bytes, other_bytes) + FIXED_BUFFER
        tool = [sys.executable, "tools/convert_checkpoint.py"]
        runs = {"imports": measured([sys.executable, "-c", IMPORTS], args.dir),
                "copy": measured([sys.executable, "-c", COPY, hf, copy], args.dir)}
        shutil.rmtree(copy)
        runs["hf_to_mlite"] = measured(tool + ["--direction", "hf-to-mlite", "--load-dir", hf, "--save-dir", mlite],
                                       args.dir)
        runs["mlite_to_hf"] = measured(tool + ["--direction", "mlite-to-hf", "--load-dir", mlite, "--save-dir", back],
                                       args.dir)
        round_trip = identical(hf, back)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    for name in ("copy", "hf_to_mlite", "mlite_to_hf"):
        runs[name]["gb_per_second"] = round(size / 1e9 / runs[name]["seconds"], 3)
        runs[name]["seconds_per_gb"] = round(runs[name]["seconds"] / (size / 1e9), 2)
    conversions = ("hf_to_mlite", "mlite_to_hf")
    figures = {
        "shape": args.shape, "hf_config": c, "dtype": "bfloat16", "safetensors_bytes": size,
        "parameters": size // 2, "generate_seconds": round(generate_seconds, 1),
        "largest_layer_bytes": layer_bytes, "largest_non_layer_tensor_bytes": other_bytes,
        "fixed_buffer_bytes": FIXED_BUFFER,
        "bound": "2 x max(largest_layer_bytes, largest_non_layer_tensor_bytes) + fixed_buffer_bytes",
        "bound_bytes": bound, "imports_peak_rss_bytes": runs.pop("imports")["peak_rss_bytes"], "runs": runs,
        "within_bound": {name: runs[name]["peak_rss_bytes"] < bound for name in conversions},
        "round_trip_identical": round_trip, "load_average": os.getloadavg()}
    print(f"{args.shape}: {size / 1e9:.2f} GB of bf16 safetensors, largest layer {layer_bytes / 1e9:.3f} GB, largest "
          f"other tensor {other_bytes / 1e9:.3f} GB -> bound {bound / 1e9:.2f} GB (generated in "
          f"{generate_seconds:.0f} s); fresh processes:")
    for name, run in runs.items():
        print(f"  {name:<12} peak RSS {run['peak_rss_bytes'] / 1e9:5.2f} GB  {run['seconds']:7.1f} s "
              f"({run['tool_done_in_seconds']} s by the tool)  "
              f"{run['seconds_per_gb']:5.2f} s/GB  {run['gb_per_second']:.3f} GB/s")
    print(f"  within bound: {figures['within_bound']}; HF -> ours -> HF tensors identical: {round_trip}; "
          f"load average {os.getloadavg()[0]:.1f}")
    if not args.no_record:
        record_result("convert_checkpoint", figures, argv)


if __name__ == "__main__":
    main(sys.argv)
