"""Raw-text loader throughput: tokens/s one loader worker delivers against the tokenizer's own encode rate on one
core, and the workers a Llama-3.2-1B run on one H200 at 50% MFU would need.

The corpus is synthetic English-like text (Zipf-distributed words), the tokenizer a byte-level BPE trained on
it with the `tokenizers` library (vocabulary --vocab-size), saved as a tokenizer.json and read through
--tokenizer-type HuggingFaceTokenizer as a training run reads it. Both rates use one thread
(RAYON_NUM_THREADS=1). The loader is a RawTextDataset with one worker process, read to the end of its
samples in the main process, as build_data_iterator reads it; its rate is tokens delivered per wall second.
The tokens per second a run consumes are peak x MFU / training_flops_per_token (megatron_lite/logging.py).

    python -m benchmarks.raw_text_loader [--documents 4000] [--vocab-size 8000]
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
from megatron_lite.config import ModelConfig  # noqa: E402
from megatron_lite.data.raw_text import RawTextDataset  # noqa: E402
from megatron_lite.data.raw_text_sources import list_chunks  # noqa: E402
from megatron_lite.data.raw_text_stream import TokenizerSpec  # noqa: E402
from megatron_lite.logging import peak_tflops_of, training_flops_per_token  # noqa: E402
from megatron_lite.presets import MODEL_PRESETS  # noqa: E402

SEQ_LENGTH, MFU = 8192, 0.5


def write_corpus(folder: str, documents: int) -> tuple[str, list[str]]:
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(1, 10))) for _ in range(20000)]
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    lengths = rng.integers(200, 1200, size=documents)
    drawn = iter(rng.choice(len(words), size=int(lengths.sum()), p=weights).tolist())
    texts = [" ".join(words[next(drawn)] for _ in range(n)) + "." for n in lengths]
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return path, texts


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


def loader_rate(path: str, spec: TokenizerSpec, tokens_in_corpus: int) -> float:
    samples = tokens_in_corpus // SEQ_LENGTH - 1  # one epoch
    dataset = RawTextDataset([(path, list_chunks(path, 2**20))], None, samples, SEQ_LENGTH, 1234, "text", spec,
                             workers=1, skip_bad_records=0)
    start = time.perf_counter()
    delivered = sum(len(sample) - 1 for _, sample in dataset.samples(0))
    return delivered / (time.perf_counter() - start)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=4000)
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args(argv[1:])
    with tempfile.TemporaryDirectory() as folder:
        path, texts = write_corpus(folder, args.documents)
        spec = TokenizerSpec("HuggingFaceTokenizer", train_tokenizer(folder, texts, args.vocab_size), None)
        encode = encode_rate(spec, texts)
        tokens = sum(len(t) for t in [spec.build().tokenize(x) for x in texts]) + len(texts)
        loader = loader_rate(path, spec, tokens)
    model = ModelConfig(**{k: v for k, v in MODEL_PRESETS["llama3.2-1b"].items() if hasattr(ModelConfig, k)})
    model.seq_length = SEQ_LENGTH
    flops = training_flops_per_token(model)
    needed = MFU * peak_tflops_of("H200") * 1e12 / flops
    figures = {"documents": args.documents, "corpus_tokens": tokens, "vocab_size": args.vocab_size,
               "seq_length": SEQ_LENGTH, "tokenizer_encode_tokens_per_s_one_core": round(encode),
               "loader_tokens_per_s_one_worker": round(loader), "loader_vs_encode": round(loader / encode, 3),
               "llama3.2_1b_training_flops_per_token": flops, "h200_peak_tflops": peak_tflops_of("H200"),
               "tokens_per_s_at_50pct_mfu": round(needed), "workers_needed": math.ceil(needed / loader)}
    for key, value in figures.items():
        print(f"{key}: {value}")
    record_result("raw_text_loader", figures, argv)


if __name__ == "__main__":
    main(sys.argv)
