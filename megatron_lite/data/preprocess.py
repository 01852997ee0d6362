"""Tokenizes a raw-text corpus into Megatron `.bin`/`.idx` files, in parallel worker processes.

JSON lines: each worker reads, decodes and tokenizes a byte range of the input itself and sends
back only the range's tokens as one bytes object and its document lengths, so that the parent,
which shares the cores with the workers, does little more than append them to the `.bin`. Other
formats: the parent reads documents in batches (through `datasets`) and sends them to the workers.
Either way the parent writes the results in input order, so the output is the same for any number
of workers. Each --json-keys column becomes its own `PREFIX_KEY_document` dataset, as in Megatron.
"""

import array
import collections
import contextlib
import multiprocessing
import sys
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from megatron_lite.data.corpus import (
    check_jsonl_keys,
    jsonl_files,
    jsonl_ranges,
    load_corpus,
    raise_first_bad_line,
    read_jsonl_range,
)
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder, check_dtype_holds, smallest_dtype
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.errors import DataError

_BATCH_DOCUMENTS = 64

# Bytes of JSON lines per worker task: small enough that the last tasks leave no worker idle for long
# and a task's tokens are a few hundred kilobytes in memory, large enough that each costs one message.
_RANGE_BYTES = 1 << 20

# array.array type codes of the token dtypes: extending an array with an id it cannot hold raises.
_TYPECODES = {np.dtype(np.uint8): "B", np.dtype(np.uint16): "H", np.dtype(np.int32): "i", np.dtype(np.int64): "q"}

# Batches in flight per worker: enough to keep workers busy, few enough to bound memory.
_BATCHES_IN_FLIGHT = 4

_worker_tokenizer = None
_worker_append_eod = False
_worker_dtype = np.dtype(np.int64)


@dataclass
class PreprocessStats:
    """What one output dataset received."""

    prefix: str
    documents: int = 0
    empty_documents: int = 0
    tokens: int = 0


def output_prefix_for(output_prefix: str, key: str) -> str:
    """Megatron's output naming: `OUT_text_document` for --json-keys text."""
    return f"{output_prefix}_{key}_document"


def _init_worker(tokenizer_args: tuple, append_eod: bool, dtype: np.dtype) -> None:
    global _worker_tokenizer, _worker_append_eod, _worker_dtype
    _worker_tokenizer = build_tokenizer(*tokenizer_args)
    _worker_append_eod = append_eod
    _worker_dtype = dtype


def _encode_batch(batch: dict[str, list]) -> dict[str, list[np.ndarray]]:
    """Token arrays for a batch of documents per key; an empty document gives an empty array."""
    encoded = {}
    for key, texts in batch.items():
        arrays = []
        for text in texts:
            ids = _worker_tokenizer.tokenize(text) if text else []
            if ids and _worker_append_eod:
                ids.append(_worker_tokenizer.eod)
            arrays.append(np.array(ids, dtype=_worker_dtype))
        encoded[key] = arrays
    return encoded


@dataclass
class EncodedRange:
    """One key's documents from a byte range of JSON lines: tokens back to back, and their lengths."""

    tokens: bytes
    lengths: np.ndarray  # int32, one per document with text
    empty_documents: int


def _encode_range(task: tuple[str, int, int, list[str]]) -> dict[str, EncodedRange]:
    """Read and tokenize the JSON lines that start in bytes [start, end) of a file, per key."""
    path, start, end, keys = task
    tokens = {key: array.array(_TYPECODES[_worker_dtype]) for key in keys}
    lengths = {key: [] for key in keys}
    empty = dict.fromkeys(keys, 0)
    eod = [_worker_tokenizer.eod] if _worker_append_eod else []
    for record in read_jsonl_range(path, start, end, keys):
        for key in keys:
            ids = _worker_tokenizer.tokenize(record[key]) if record[key] else []
            if not ids:
                empty[key] += 1
                continue
            try:
                tokens[key].extend(ids)
                tokens[key].extend(eod)
            except OverflowError:
                raise ValueError(f"token id {max(ids + eod)} does not fit dtype {_worker_dtype}; "
                                 f"use a wider --dtype") from None
            lengths[key].append(len(ids) + len(eod))
    return {key: EncodedRange(tokens[key].tobytes(), np.array(lengths[key], dtype=np.int32), empty[key])
            for key in keys}


def preprocess(inputs: list[str], output_prefix: str, json_keys: list[str], tokenizer_type: str,
               tokenizer_model: str | None = None, vocab_size: int | None = None, append_eod: bool = False,
               workers: int = 1, dtype: str | None = None, cache_dir: str | None = None,
               progress: bool = True) -> dict[str, PreprocessStats]:
    """Tokenize `inputs` and write one indexed dataset per json key; returns what each received."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1 (got {workers})")
    tokenizer_args = (tokenizer_type, tokenizer_model, vocab_size)
    tokenizer = build_tokenizer(*tokenizer_args)
    token_dtype = np.dtype(dtype) if dtype else smallest_dtype(tokenizer.vocab_size)
    check_dtype_holds(token_dtype, tokenizer.vocab_size)
    _init_worker(tokenizer_args, append_eod, token_dtype)
    pool = _start_pool(workers, tokenizer_args, append_eod, token_dtype) if workers > 1 else None
    try:
        files = jsonl_files(inputs)
        if files is not None:
            return _preprocess_jsonl(files, pool, output_prefix, json_keys, token_dtype, workers, progress)
        corpus = load_corpus(inputs, json_keys, cache_dir=cache_dir)
        batches = corpus.batches(json_keys, _BATCH_DOCUMENTS)
        results = map(_encode_batch, batches) if pool is None else _ordered_map(pool, batches, workers)
        return _write(results, output_prefix, json_keys, token_dtype, total=len(corpus), progress=progress)
    finally:
        if pool is not None:
            pool.terminate()


def _preprocess_jsonl(files: list[str], pool, output_prefix: str, json_keys: list[str], dtype: np.dtype,
                      workers: int, progress: bool) -> dict[str, PreprocessStats]:
    """Tokenize JSON lines, each worker reading its own byte ranges; a malformed line is named FILE:LINE."""
    check_jsonl_keys(files, json_keys)
    ranges = jsonl_ranges(files, _RANGE_BYTES)
    tasks = ((path, start, end, json_keys) for path, start, end in ranges)
    results = map(_encode_range, tasks) if pool is None else _ordered_map(pool, tasks, workers, _encode_range)
    try:
        return _write_ranges(results, output_prefix, json_keys, dtype, total=len(ranges), progress=progress)
    except (ValueError, UnicodeDecodeError):
        for path in files:
            raise_first_bad_line(path, "json")
        raise


def _start_pool(workers: int, tokenizer_args: tuple, append_eod: bool, dtype: np.dtype):
    """Tokenizer processes, forked on Linux before the reader starts any threads.

    A forked worker is ready in about 0.1 s; a spawned one re-imports Python modules for a second
    or more, which is most of the run on a small corpus. Elsewhere fork is unsafe, so we spawn.
    """
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    return context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_args, append_eod, dtype))


def _ordered_map(pool, batches, workers: int, function=_encode_batch):
    """`pool.imap(function, batches)` with a bounded number of batches read ahead.

    imap reads its whole input as fast as it can; a corpus larger than memory needs the bound.
    """
    window = _BATCHES_IN_FLIGHT * workers
    pending = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(function, (batch,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


@contextlib.contextmanager
def _datasets(output_prefix: str, json_keys: list[str], dtype: np.dtype):
    """The stats and builders of one dataset per json key, finalized when the block ends well; on any
    failure (an empty output included) every partial file is removed, so nothing is left behind."""
    stats = {key: PreprocessStats(output_prefix_for(output_prefix, key)) for key in json_keys}
    builders = {key: IndexedDatasetBuilder(stats[key].prefix, dtype) for key in json_keys}
    try:
        yield stats, builders
        _refuse_empty_outputs(stats)
        for builder in builders.values():
            builder.finalize()
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise


def _write(results, output_prefix: str, json_keys: list[str], dtype: np.dtype, total: int,
           progress: bool) -> dict[str, PreprocessStats]:
    """Append each encoded batch to the datasets, in order."""
    start = time.perf_counter()
    tokens = 0
    with _datasets(output_prefix, json_keys, dtype) as (stats, builders), \
            tqdm(total=total, unit="doc", disable=not progress, desc="tokenizing") as bar:
        for encoded in results:
            for key, arrays in encoded.items():
                for array in arrays:
                    if array.size == 0:
                        stats[key].empty_documents += 1
                        continue
                    builders[key].add_document(array)
                    stats[key].documents += 1
                    stats[key].tokens += array.size
                    tokens += array.size
            bar.update(len(arrays))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f} tokens/s", refresh=False)
    return stats


def _write_ranges(results, output_prefix: str, json_keys: list[str], dtype: np.dtype, total: int,
                  progress: bool) -> dict[str, PreprocessStats]:
    """Append each range's tokens to the datasets, in order."""
    with _datasets(output_prefix, json_keys, dtype) as (stats, builders), \
            tqdm(total=total, unit="MiB", disable=not progress, desc="tokenizing") as bar:
        for encoded in results:
            for key, part in encoded.items():
                builders[key].add_documents(part.tokens, part.lengths)
                stats[key].documents += len(part.lengths)
                stats[key].empty_documents += part.empty_documents
                stats[key].tokens += len(part.tokens) // dtype.itemsize
            bar.update(1)
    return stats


def _refuse_empty_outputs(stats: dict[str, PreprocessStats]) -> None:
    """Raise DataError when a json key received no document with text: an empty dataset would only
    fail later, at training time, far from the input that caused it."""
    for key, s in stats.items():
        if s.documents == 0:
            raise DataError(f"the input holds no documents with text under --json-keys {key} "
                            f"({s.empty_documents} empty ones); nothing was written to {s.prefix}.bin/.idx")
