"""GPTDataset index build time and peak memory on a synthetic 1e9-token indexed dataset.

    python -m benchmarks.dataset_index                       # 2M documents of ~500 tokens, seq 4096

The .idx is real (Megatron's format: random document lengths averaging --mean-length tokens); the
.bin is a sparse file of the right size, since opening a dataset and building its indices read only
the index. Not measured: the token-id scan (builder.check_token_ids), which reads the whole .bin once
per dataset and is cached after that. Each phase runs in a fresh process, so its peak resident memory
(ru_maxrss) is its own; `traced peak` is the most memory numpy and Python held at once during the phase
(tracemalloc), which excludes the interpreter and the mapped files. Phases:

- open: IndexedDataset(prefix): maps the .idx and checks it against the .bin size (pointers, document
  indices), which every rank does on every start;
- build_indices: document, sample and shuffle indices of the train split (969/1000 of the documents)
  for --epochs epochs of --seq-length samples, in memory;
- build_and_save: GPTDataset with an empty cache: open, build, write the .npy files (the first rank);
- load_cached: GPTDataset whose indices are cached: what every other rank and every restart does, the
  peer the first rank's build is compared with.

Figures are appended to benchmarks/results/dataset_index.jsonl with the machine's load average.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc

import numpy as np

from benchmarks.results_file import record_result
from megatron_lite.data.builder import split_ranges
from megatron_lite.data.gpt_dataset import GPTDataset, build_indices
from megatron_lite.data.indexed_dataset import (
    _HEADER,
    DTYPE_CODES,
    INDEX_MAGIC,
    INDEX_VERSION,
    IndexedDataset,
    bin_path,
    idx_path,
)

PHASES = ("open", "build_indices", "build_and_save", "load_cached")
SEED = 1234


def write_synthetic_dataset(prefix: str, documents: int, mean_length: int, seed: int = 0) -> int:
    """Write PREFIX.idx for `documents` uint16 documents of 1 .. 2 * mean_length - 1 tokens and a sparse
    PREFIX.bin of the matching size; returns the token count."""
    lengths = np.random.default_rng(seed).integers(1, 2 * mean_length, size=documents, dtype=np.int32)
    dtype = np.dtype(np.uint16)
    pointers = np.zeros(documents, dtype=np.int64)
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= dtype.itemsize
    document_indices = np.arange(documents + 1, dtype=np.int64)
    with open(idx_path(prefix), "wb") as f:
        f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, DTYPE_CODES[dtype], documents, documents + 1))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(document_indices.tobytes())
    num_tokens = int(lengths.sum(dtype=np.int64))
    with open(bin_path(prefix), "wb") as f:
        f.truncate(num_tokens * dtype.itemsize)
    return num_tokens


def samples_for(dataset: IndexedDataset, train_range: tuple[int, int], seq_length: int, epochs: int) -> int:
    tokens = int(dataset.sequence_lengths[slice(*train_range)].sum(dtype=np.int64))
    return epochs * (tokens - 1) // seq_length


def run_phase(phase: str, prefix: str, cache_dir: str, seq_length: int, epochs: int) -> dict:
    """Run one phase in this process; returns its seconds and peak memory."""
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    start = time.perf_counter()
    dataset = IndexedDataset(prefix)
    if phase != "open":
        train_range = split_ranges(len(dataset), [0.969, 0.03, 0.001])[0]
        num_samples = samples_for(dataset, train_range, seq_length, epochs)
        if phase == "build_indices":
            build_indices(dataset.sequence_lengths, np.arange(*train_range, dtype=np.int64), num_samples,
                          seq_length, SEED)
        else:
            GPTDataset(dataset, train_range, num_samples, seq_length, SEED, cache_dir)
    seconds = time.perf_counter() - start
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"seconds": round(seconds, 3), "traced_peak_mib": round(traced_peak / 2**20, 1),
            "peak_rss_mib": round(peak_rss / 1024, 1), "rss_growth_mib": round((peak_rss - baseline_rss) / 1024, 1)}


def run_in_fresh_process(phase: str, args: argparse.Namespace, prefix: str, cache_dir: str) -> dict:
    command = [sys.executable, "-m", "benchmarks.dataset_index", "--phase", phase, "--prefix", prefix,
               "--cache-dir", cache_dir, "--seq-length", str(args.seq_length), "--epochs", str(args.epochs)]
    out = subprocess.run(command, check=True, capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=2_000_000)
    parser.add_argument("--mean-length", type=int, default=500, help="mean tokens per document")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=1, help="epochs of the train split to build samples for")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each phase; the fastest is reported")
    parser.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv[1:])
    if args.phase:  # a child process: one phase, figures as one JSON line
        print(json.dumps(run_phase(args.phase, args.prefix, args.cache_dir, args.seq_length, args.epochs)))
        return
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "synthetic_text_document")
        num_tokens = write_synthetic_dataset(prefix, args.documents, args.mean_length)
        print(f"{args.documents:,} documents, {num_tokens:,} tokens; idx {os.path.getsize(idx_path(prefix)):,} bytes")
        figures = {phase: [] for phase in PHASES}
        for repeat in range(args.repeats):
            cache_dir = os.path.join(folder, f"cache{repeat}")
            for phase in PHASES:  # load_cached follows build_and_save, which filled cache_dir
                figures[phase].append(run_in_fresh_process(phase, args, prefix, cache_dir))
    best = {phase: min(runs, key=lambda r: r["seconds"]) for phase, runs in figures.items()}
    for phase, result in best.items():
        print(f"{phase:>15}: {result['seconds']:7.3f} s, traced peak {result['traced_peak_mib']:7.1f} MiB, "
              f"peak RSS {result['peak_rss_mib']:7.1f} MiB (+{result['rss_growth_mib']:.1f})")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")
    record_result("dataset_index", {"documents": args.documents, "tokens": num_tokens, "seq_length": args.seq_length,
                                    "epochs": args.epochs, "repeats": args.repeats, "load_average": list(load),
                                    "fastest_of_repeats": best, "all_runs": figures}, argv)


if __name__ == "__main__":
    main(sys.argv)
