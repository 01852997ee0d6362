"""Raw-text loader throughput: tokens/s one loader worker delivers against the tokenizer's own encode rate on one
core, and the workers a Llama-3.2-1B run on one H200 at 50% MFU would need.

The corpus is synthetic English-like text (Zipf-distributed words), or the texts of a JSON-lines file
(--corpus, e.g. data/shakespeare.jsonl); the tokenizer a byte-level BPE trained on it with the `tokenizers`
library (vocabulary --vocab-size), saved as a tokenizer.json and read through --tokenizer-type
HuggingFaceTokenizer as a training run reads it. Both rates use one thread (RAYON_NUM_THREADS=1). The
loader is a RawTextDataset with one worker process, read to the end of one epoch of samples in the main
process, as build_data_iterator reads it; its rate is tokens delivered per wall second, the worker's
start-up included, beside the worker's own rate (tokens per second it spent reading and tokenizing, what
the training log line reports) and the rate with no worker (--num-workers 0: reading, tokenizing and packing
in the main process, the loader's whole path on one core, which no second process competes with). The
tokens per second a run consumes are peak x MFU / training_flops_per_token (megatron_lite/model/flops.py). On a
shared machine every rate falls with its load, which varies within seconds: they are measured in turn
--repeats times and the best of each kept, and the load averages before and after are recorded.

    python -m benchmarks.raw_text_loader [--documents 4000] [--corpus FILE.jsonl] [--vocab-size 8000] [--repeats 3]
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # one core for the tokenizer, in this process and the worker
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

from benchmarks.results_file import record_result  # noqa: E402
from megatron_lite.config.presets import MODEL_PRESETS  # noqa: E402
from megatron_lite.config.sections import ModelConfig  # noqa: E402
from megatron_lite.data.raw_text import RawTextDataset  # noqa: E402
from megatron_lite.data.raw_text_sources import list_chunks  # noqa: E402
from megatron_lite.data.raw_text_stream import TokenizerSpec  # noqa: E402
from megatron_lite.model.flops import training_flops_per_token  # noqa: E402
from megatron_lite.training.logging import peak_tflops_of  # noqa: E402

SEQ_LENGTH, MFU = 8192, 0.5
CHUNK_BYTES = 2**20  # --raw-text-chunk-mib 1: a few chunks for the prefetch to work ahead on


def write_corpus(folder: str, documents: int, corpus: str | None) -> tuple[str, list[str]]:
    if corpus is not None:
        with open(corpus) as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()][:documents]
        return _write_jsonl(folder, texts), texts
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(20000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    lengths = rng.integers(200, 1200, size=documents)
    drawn = iter(rng.choice(len(words), size=int(lengths.sum()), p=weights).tolist())
    texts = [" ".join(words[next(drawn)] for _ in range(n)) + "." for n in lengths]
    return _write_jsonl(folder, texts), texts


def _write_jsonl(folder: str, texts: list[str]) -> str:
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def train_tokenizer(folder: str, texts: list[str], vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size,
                                                             special_tokens=["<|endoftext|>"]))
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    return folder


def encode_rate(spec: TokenizerSpec, texts: list[str]) -> float:
    tokenizer = spec.build()
    start = time.perf_counter()
    tokens = sum(len(tokenizer.tokenize(text)) + 1 for text in texts)
    return tokens / (time.perf_counter() - start)


def loader_rates(path: str, spec: TokenizerSpec, tokens_in_corpus: int, workers: int = 1) -> tuple[float, float, float]:
    """(tokens delivered per wall second, start-up included; the worker's own tokens per second of reading and
    tokenizing, the figure the training log reports; seconds to the first sample). With `workers` 0 the main
    process reads and tokenizes too: the loader's whole path on one core."""
    samples = tokens_in_corpus // SEQ_LENGTH - 1  # one epoch
    dataset = RawTextDataset([(path, list_chunks(path, CHUNK_BYTES))], None, samples, SEQ_LENGTH, 1234, "text",
                             spec, workers=workers, skip_bad_records=0)
    start = time.perf_counter()
    stream = dataset.samples(0)
    delivered = len(next(stream)[1]) - 1
    first = time.perf_counter()
    delivered += sum(len(sample) - 1 for _, sample in stream)
    return delivered / (time.perf_counter() - start), dataset.loader_tokens_per_sec(), first - start


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=4000, help="documents (of --corpus: at most)")
    parser.add_argument("--corpus", help="a JSON-lines file whose 'text' values are the corpus (default: synthetic)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each rate, the best kept")
    args = parser.parse_args(argv[1:])
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        path, texts = write_corpus(folder, args.documents, args.corpus)
        spec = TokenizerSpec("HuggingFaceTokenizer", train_tokenizer(folder, texts, args.vocab_size), None)
        tokens = sum(len(t) for t in [spec.build().tokenize(x) for x in texts]) + len(texts)
        encodes, loaders, in_process = [], [], []
        for _ in range(args.repeats):
            encodes.append(encode_rate(spec, texts))
            loaders.append(loader_rates(path, spec, tokens))
            in_process.append(loader_rates(path, spec, tokens, workers=0)[0])
        encode = max(encodes)
        loader, worker, startup = max(loaders)
    model = ModelConfig(**{k: v for k, v in MODEL_PRESETS["llama3.2-1b"].items() if hasattr(ModelConfig, k)})
    model.seq_length = SEQ_LENGTH
    flops = training_flops_per_token(model)
    needed = MFU * peak_tflops_of("H200") * 1e12 / flops
    figures = {"corpus": args.corpus or "synthetic", "documents": len(texts), "corpus_tokens": tokens,
               "vocab_size": args.vocab_size,
               "seq_length": SEQ_LENGTH, "tokenizer_encode_tokens_per_s_one_core": round(encode),
               "loader_tokens_per_s_one_worker": round(loader), "loader_vs_encode": round(loader / encode, 3),
               "loader_worker_own_tokens_per_s": round(worker), "worker_own_vs_encode": round(worker / encode, 3),
               "loader_seconds_to_first_sample": round(startup, 2),
               "loader_in_process_tokens_per_s": round(max(in_process)),
               "in_process_vs_encode": round(max(in_process) / encode, 3), "repeats": args.repeats,
               "encode_tokens_per_s_each": [round(r) for r in encodes],
               "loader_tokens_per_s_each": [round(r[0]) for r in loaders],
               "llama3.2_1b_training_flops_per_token": flops, "h200_peak_tflops": peak_tflops_of("H200"),
               "tokens_per_s_at_50pct_mfu": round(needed), "workers_needed": math.ceil(needed / loader),
               "load_average_1min_before_after": [round(load_before[0], 1), round(os.getloadavg()[0], 1)]}
    for key, value in figures.items():
        print(f"{key}: {value}")
    record_result("raw_text_loader", figures, argv)


if __name__ == "__main__":
    main(sys.argv)
