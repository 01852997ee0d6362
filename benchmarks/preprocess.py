"""Preprocessing throughput on the demo corpus: tools/preprocess_data.py against a datasets.map baseline.

    python benchmarks/preprocess.py            # needs data/shakespeare.jsonl (tools/download_demo_corpus.py)

Both sides read the same jsonl through `datasets`, use the same sentencepiece tokenizer (one is
trained into a temporary folder when data/tokenizer.model is missing), append the eod token, and
write every token to disk: ours as Megatron .bin/.idx, the baseline as the plain recipe
`load_dataset(...).map(tokenize, batched=True, num_proc=N)` then one numpy array saved with
np.save. A third peer is the sp.encode limit: 1 or 2 processes doing nothing but sp.encode on texts
already in memory; each pipeline's tokens/s is reported as a share of it. Each configuration runs
--repeats times, interleaved with the others, and reports the median
wall time, from reading the input to files on disk. The outputs are checked to hold the same tokens. Results go to
benchmarks/results/preprocess_DATE.{json,md}.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from megatron_lite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megatron_lite.data.preprocess import preprocess  # noqa: E402
from megatron_lite.data.tokenizer_training import train_sentencepiece  # noqa: E402
from megatron_lite.data.tokenizers import build_tokenizer  # noqa: E402


def run_ours(corpus: str, tokenizer: str, workers: int, folder: str, cache: str) -> np.ndarray:
    preprocess([corpus], os.path.join(folder, "out"), ["text"], "SentencePieceTokenizer", tokenizer,
               append_eod=True, workers=workers, cache_dir=cache, progress=False)
    ds = IndexedDataset(os.path.join(folder, "out_text_document"))
    return ds.get(0, 0, ds.num_tokens)


def run_baseline(corpus: str, tokenizer: str, workers: int, folder: str, cache: str) -> np.ndarray:
    import datasets

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer)

    def tokenize(batch):
        return {"ids": [tok.tokenize(text) + [tok.eod] for text in batch["text"] if text]}

    table = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    tokenized = table.map(tokenize, batched=True, remove_columns=table.column_names, load_from_cache_file=False,
                          num_proc=workers if workers > 1 else None,
                          cache_file_name=os.path.join(folder, "map.arrow"))
    tokens = np.concatenate([np.asarray(ids, dtype=np.uint16)
                             for batch in tokenized.iter(batch_size=1000) for ids in batch["ids"]])
    np.save(os.path.join(folder, "tokens.npy"), tokens)
    return np.load(os.path.join(folder, "tokens.npy"), mmap_mode="r")


def _encode_share(args: tuple[str, str, int, int]) -> tuple[int, float]:
    """(tokens, seconds) of one process doing nothing but sp.encode on its share of the documents."""
    corpus, tokenizer, part, parts = args
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer)
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f][part::parts]
    start = time.perf_counter()
    tokens = sum(len(tok.tokenize(text)) + 1 for text in texts if text)
    return tokens, time.perf_counter() - start


def encode_limit(corpus: str, tokenizer: str, workers: int) -> float:
    """Tokens/s of `workers` processes doing nothing but sp.encode on texts already in memory: the most any
    preprocessing pipeline with that many tokenizer processes can reach."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(workers) as pool:
        shares = pool.map(_encode_share, [(corpus, tokenizer, part, workers) for part in range(workers)])
    return sum(tokens for tokens, _ in shares) / max(seconds for _, seconds in shares)


def timed(fn, corpus: str, tokenizer: str, workers: int, cache: str) -> tuple[float, np.ndarray]:
    """(seconds, tokens written) for one run into a fresh folder."""
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        tokens = fn(corpus, tokenizer, workers, folder, cache)
        seconds = time.perf_counter() - start
        return seconds, np.array(tokens)


def machine() -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    import datasets
    import sentencepiece

    return {"cpu": cpu, "cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__, "datasets": datasets.__version__,
            "sentencepiece": sentencepiece.__version__}


def git_commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=str(REPO / "data/shakespeare.jsonl"))
    parser.add_argument("--tokenizer-model", default=str(REPO / "data/tokenizer.model"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-dir", default=str(REPO / "benchmarks/results"))
    args = parser.parse_args()
    if not os.path.isfile(args.corpus):
        sys.exit(f"{args.corpus} not found; run `python tools/download_demo_corpus.py` first")

    with tempfile.TemporaryDirectory() as scratch:
        cache = os.path.join(scratch, "hf")
        tokenizer = args.tokenizer_model
        if not os.path.isfile(tokenizer):
            tokenizer = train_sentencepiece([args.corpus], os.path.join(scratch, "tok"), 4000, ["text"],
                                            cache_dir=cache, progress=False)
        vocab_size = build_tokenizer("SentencePieceTokenizer", tokenizer).vocab_size
        import datasets

        datasets.disable_progress_bars()
        datasets.load_dataset("json", data_files=args.corpus, split="train", cache_dir=cache)  # parse once
        configurations = [("megatron_lite preprocess", run_ours, 1), ("megatron_lite preprocess", run_ours, 2),
                          ("datasets.map baseline", run_baseline, 1), ("datasets.map baseline", run_baseline, 2)]
        times = [[] for _ in configurations]
        limits = {1: [], 2: []}
        reference = None
        for _ in range(args.repeats):  # configurations interleaved, so a change in machine load hits all
            for workers, measured in limits.items():
                measured.append(encode_limit(args.corpus, tokenizer, workers))
            for (name, fn, workers), seconds in zip(configurations, times):
                elapsed, tokens = timed(fn, args.corpus, tokenizer, workers, cache)
                reference = tokens if reference is None else reference
                if not np.array_equal(tokens, reference):
                    sys.exit(f"{name} with {workers} workers wrote different tokens")
                seconds.append(elapsed)
        runs = []
        for (name, _, workers), seconds in zip(configurations, times):
            median = statistics.median(seconds)
            runs.append({"name": name, "workers": workers, "seconds_median": round(median, 3),
                         "seconds": [round(t, 3) for t in seconds], "tokens_per_s": round(len(reference) / median)})
            print(f"{name:26s} workers={workers}: {median:6.2f} s  {len(reference) / median:12,.0f} tokens/s")
        limit = {workers: round(statistics.median(measured)) for workers, measured in limits.items()}
        for r in runs:
            r["share_of_encode_limit"] = round(r["tokens_per_s"] / limit[r["workers"]], 3)

    with open(args.corpus) as f:
        documents = sum(1 for _ in f)
    baseline = {r["workers"]: r["tokens_per_s"] for r in runs if r["name"].startswith("datasets")}
    for r in runs:
        r["speedup_vs_baseline_same_workers"] = round(r["tokens_per_s"] / baseline[r["workers"]], 2)
    result = {"benchmark": "preprocess", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "python benchmarks/preprocess.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
              "machine": machine(), "corpus": os.path.relpath(args.corpus, REPO), "documents": documents,
              "tokens": int(len(reference)), "tokenizer": f"sentencepiece BPE, {vocab_size} ids",
              "repeats": args.repeats, "encode_limit_tokens_per_s": limit, "runs": runs}
    write_results(result, args.output_dir)


def write_results(result: dict, output_dir: str) -> None:
    os.makedirs(output_dir, exist_ok=True)
    stem = os.path.join(output_dir, f"preprocess_{result['date'][:10]}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=2)
    m = result["machine"]
    lines = [f"# Preprocessing throughput, {result['date']}", "",
             f"`{result['command']}` at commit {result['commit']} on {m['cpu']} ({m['cpu_count']} cores), "
             f"{m['platform']}, Python {m['python']}, datasets {m['datasets']}, sentencepiece {m['sentencepiece']}; "
             f"1-minute load average {m['load_average_1min']} when the runs ended.",
             "", f"Corpus: {result['corpus']}, {result['documents']} documents, {result['tokens']:,} tokens "
             f"({result['tokenizer']}, eod appended). Median of {result['repeats']} runs, from reading the input "
             f"to tokens on disk; all outputs hold the same tokens.", "",
             "The sp.encode limit is what the same number of processes doing nothing but sp.encode on texts "
             f"already in memory reach: {result['encode_limit_tokens_per_s'][1]:,} tokens/s with one, "
             f"{result['encode_limit_tokens_per_s'][2]:,} with two.", "",
             "| pipeline | workers | seconds | tokens/s | vs. baseline, same workers | of the sp.encode limit |",
             "|---|---|---|---|---|---|"]
    if m["load_average_1min"] > m["cpu_count"]:
        lines[-2:-2] = [f"The machine was shared (load {m['load_average_1min']} on {m['cpu_count']} cores): the "
                        f"absolute figures understate an idle machine; compare rows of this run.", ""]
    for r in result["runs"]:
        lines.append(f"| {r['name']} | {r['workers']} | {r['seconds_median']:.2f} | {r['tokens_per_s']:,} | "
                     f"{r['speedup_vs_baseline_same_workers']:.2f}x | {r['share_of_encode_limit']:.0%} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
