"""Conversion time of tools/convert_checkpoint.py for a ~1.2B-parameter Llama, against plain copies of the files.

The model is Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads / 8 KV heads, SwiGLU 8192, vocabulary
128256, tied embeddings; plain RoPE, since we refuse Llama 3's RoPE scaling), built by transformers from a
config with no download, in bf16 with random weights (tiled from a small random pool: drawing 1.2B normal
values costs more than everything measured here) and saved with save_pretrained in 1 GB shards.
Measured in the same run, each a fresh process as a user would run it:

  hf-to-mlite    tools/convert_checkpoint.py: read the safetensors, fuse QKV and [gate; up], write the DCP checkpoint
  mlite-to-hf    tools/convert_checkpoint.py: read the checkpoint, split, write 1 GB safetensors shards
  copy           the peer: the same shards read with safetensors.load_file and written with save_file, the
                 least any conversion between two files has to do (also in a fresh process)

Prints seconds and the ratios to the copy, checks that HF -> ours -> HF gave back identical tensors, and
appends the figures to benchmarks/results/convert_checkpoint.jsonl.

    python -m benchmarks.convert_checkpoint [--layers 16] [--dir /tmp/convert_benchmark]
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import torch

from benchmarks.results_file import record_result

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPY = """
import glob, os, sys
from safetensors.torch import load_file, save_file
source, target = sys.argv[1:]
os.makedirs(target)
for path in sorted(glob.glob(os.path.join(source, "*.safetensors"))):
    save_file(load_file(path), os.path.join(target, os.path.basename(path)), metadata={"format": "pt"})
"""


def build_hf_model(layers: int, path: str) -> int:
    """Save a random bf16 Llama of Llama-3.2-1B's shape with `layers` layers; returns its parameter count."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                      num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()
    pool = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            flat = param.view(-1)
            flat.copy_(pool.roll(index).repeat(-(-flat.numel() // pool.numel()))[:flat.numel()])
    model.save_pretrained(path, max_shard_size="1GB")
    return sum(p.numel() for p in model.parameters())


def timed(command: list[str]) -> tuple[float, float | None]:
    """Wall seconds of a fresh process, and the conversion's own seconds (without start-up) when it says."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    reported = re.search(r"done in ([0-9.]+) s", result.stderr)
    return wall, float(reported.group(1)) if reported else None


def identical(first: str, second: str) -> bool:
    from safetensors.torch import load_file

    def tensors(folder):
        return {k: v for path in glob.glob(os.path.join(folder, "*.safetensors")) for k, v in load_file(path).items()}

    a, b = tensors(first), tensors(second)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16, help="16 is Llama-3.2-1B's depth (1.24B parameters)")
    parser.add_argument("--dir", default="/tmp/convert_benchmark")
    args = parser.parse_args(argv[1:])
    shutil.rmtree(args.dir, ignore_errors=True)
    hf, mlite, back, copy = (os.path.join(args.dir, name) for name in ("hf", "mlite", "back", "copy"))
    start = time.perf_counter()
    parameters = build_hf_model(args.layers, hf)
    build_seconds = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
    tool = [sys.executable, "tools/convert_checkpoint.py"]
    runs = {
        "copy": timed([sys.executable, "-c", COPY, hf, copy]),
        "hf_to_mlite": timed(tool + ["--direction", "hf-to-mlite", "--load-dir", hf, "--save-dir", mlite]),
        "mlite_to_hf": timed(tool + ["--direction", "mlite-to-hf", "--load-dir", mlite, "--save-dir", back,
                                     "--max-shard-size", "1GB"]),
    }
    seconds = {name: wall for name, (wall, _) in runs.items()}
    round_trip = identical(hf, back)
    figures = {"parameters": parameters, "layers": args.layers, "dtype": "bfloat16", "safetensors_bytes": size,
               "build_and_save_pretrained_seconds": round(build_seconds, 2),
               "seconds": {k: round(v, 2) for k, v in seconds.items()},
               "conversion_seconds_without_startup": {k: runs[k][1] for k in ("hf_to_mlite", "mlite_to_hf")},
               "ratio_to_copy": {k: round(seconds[k] / seconds["copy"], 2) for k in ("hf_to_mlite", "mlite_to_hf")},
               "round_trip_identical": round_trip, "load_average": os.getloadavg()}
    print(f"{parameters / 1e9:.2f}B parameters, {size / 1e9:.2f} GB of bf16 safetensors (built and saved by "
          f"transformers in {build_seconds:.1f} s); wall seconds of a fresh process:")
    for name, (wall, reported) in runs.items():
        detail = "" if name == "copy" else f"  ({wall / seconds['copy']:.2f}x the copy; {reported} s after start-up)"
        print(f"  {name:<12} {wall:6.1f} s{detail}")
    print(f"  HF -> ours -> HF tensors identical: {round_trip}; load average {os.getloadavg()[0]:.1f}")
    record_result("convert_checkpoint", figures, argv)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv)
