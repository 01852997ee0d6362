"""Training straight from raw text: --data-path (or --train-data-path ...) entries that are JSON lines,
Parquet or saved datasets are read, tokenized and packed while training runs.

The global sample sequence is a function of the sources, weights, --seed, --seq-length and tokenizer alone:
one source's samples are its stream's (raw_text_stream.py); a blend takes global sample i from source
dataset_index[i] by Megatron's greedy rule, the one the indexed BlendedDataset uses (blended_dataset.py).
Every data-parallel rank reads the whole global stream and keeps the samples the PretrainingSampler gives
it, a whole step of micro_batch_size x dp samples at a time, so after a global batch of c consumed samples
the stream stands at sample c on every rank, whatever the layout. The position of every source there is
saved with the checkpoint (`loader_state`, in metadata.json) and a resume starts from it
(`restore_loader_state`), at any DP/TP/PP/CP size and under ramp-up. Without a saved position (a validation
stream) the stream is read from the start up to the consumed samples: the same samples, later.

--split cuts each source's chunks at the rounded cumulative shares, as the indexed path cuts documents.
A blend that mixes raw text with .bin/.idx prefixes is refused: preprocess the raw part, or give only raw text.
"""

from __future__ import annotations

import math
import time
import weakref

import torch.distributed as dist

from megatron_lite.data.blended_dataset import build_blending_indices, normalize_weights
from megatron_lite.data.builder import SPLIT_NAMES, parse_data_path, parse_split, read_data_args, split_ranges
from megatron_lite.data.raw_text_sources import check_source, is_raw_text, list_chunks
from megatron_lite.data.raw_text_stream import Position, SourceStream, TokenizedChunks, TokenizerSpec
from megatron_lite.errors import DataError

REPORT_INTERVAL_S = 60.0  # how often the loader's tokens/s is logged


def _log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class RawTextDataset:
    """`num_samples` samples of seq_length + 1 tokens from raw-text sources blended by `weights`."""

    def __init__(self, sources: list[tuple[str, list]], weights: list[float] | None, num_samples: int,
                 seq_length: int, seed: int, key: str, tokenizer: TokenizerSpec, workers: int, skip_bad_records: int):
        self.names = [name for name, _ in sources]
        self.chunk_datasets = [TokenizedChunks(k, chunks, key, seed, tokenizer) for k, (_, chunks) in enumerate(sources)]
        self.num_samples, self.seq_length = num_samples, seq_length
        self.workers, self.skip_bad_records = workers, skip_bad_records
        self.dataset_index = None
        if len(sources) > 1:
            weights = normalize_weights(weights).tolist()
            size = sum(math.ceil(num_samples * w) for w in weights)  # the indexed blend's size
            self.dataset_index = build_blending_indices(weights, size)[0]
        self.positions: dict[int, list[Position]] = {}  # consumed samples -> every source's position
        self.resume: tuple[int, list[Position]] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def samples(self, start: int):
        """The global samples from `start` on, as (index, tokens)."""
        if self.resume is not None and self.resume[0] == start:
            positions, ahead = self.resume[1], 0
        else:
            positions, ahead = [Position() for _ in self.names], start
        streams = [SourceStream(ds, name, self.seq_length, p, self.workers, self.skip_bad_records, _log)
                   for ds, name, p in zip(self.chunk_datasets, self.names, positions)]
        first, last_report = start - ahead, time.perf_counter()
        for i in range(first, self.num_samples):
            stream = streams[0 if self.dataset_index is None else int(self.dataset_index[i])]
            sample = stream.next_sample()
            if i >= start:
                yield i, sample, streams
            if time.perf_counter() - last_report > REPORT_INTERVAL_S:
                last_report = time.perf_counter()
                _log(loader_rate_line(streams, self.workers))


def loader_rate_line(streams: list[SourceStream], workers: int) -> str:
    tokens = sum(s.tokens for s in streams)
    seconds = sum(s.worker_seconds for s in streams)
    return (f" raw text loader: {tokens:,} tokens read, {tokens / max(seconds, 1e-9):,.0f} tokens/s per worker "
            f"({max(workers, 1)} per source)")


def data_iterator(dataset: RawTextDataset, sampler, collate):
    """This rank's micro-batches: each step of the sampler reads the step's samples of every rank from the
    global stream, keeps its own, and records the sources' positions after the step."""
    samples = None
    kept: list = []
    for indices in sampler:
        start = indices[0] - sampler.rank * sampler.micro_batch_size
        if samples is None:
            samples = dataset.samples(start)
        wanted = set(indices)
        for i, sample, streams in samples:
            if i in wanted:
                kept.append(sample)
            if i == start + sampler.step - 1:
                break
        dataset.positions[start + sampler.step] = [s.position() for s in streams]
        for old in sorted(dataset.positions)[:-4]:  # a save asks for the latest only
            del dataset.positions[old]
        batch, kept = collate(kept), []
        yield batch


# ---------------------------------------------------------------------------------------------------------
# Which run's dataset a checkpoint belongs to


_DATASETS: dict[int, tuple] = {}  # id(config) -> (weak config, weak dataset): the train dataset of a run


def register(config, dataset: RawTextDataset) -> None:
    _DATASETS[id(config)] = (weakref.ref(config), weakref.ref(dataset))


def _dataset_of(config) -> RawTextDataset | None:
    refs = _DATASETS.get(id(config))
    if refs is None or refs[0]() is not config:
        return None
    return refs[1]()


def loader_state(config, consumed_samples: int) -> dict | None:
    """The raw-text train stream's position at `consumed_samples`, for metadata.json; None without one."""
    dataset = _dataset_of(config)
    if dataset is None or consumed_samples not in dataset.positions:
        return None
    return {"consumed_samples": consumed_samples, "sources": dataset.names,
            "positions": [vars(p) for p in dataset.positions[consumed_samples]]}


def restore_loader_state(config, state: dict | None, consumed_samples: int) -> None:
    """Start the raw-text train stream of `config`'s run where a checkpoint's `state` says."""
    dataset = _dataset_of(config)
    if dataset is None:
        return
    if state is None or state.get("consumed_samples") != consumed_samples or state.get("sources") != dataset.names:
        if consumed_samples:
            _log(f" raw text loader: the checkpoint holds no position of {', '.join(dataset.names)} at "
                 f"{consumed_samples} samples; reading the stream from its start up to there")
        return
    dataset.resume = (consumed_samples, [Position(**p) for p in state["positions"]])


# ---------------------------------------------------------------------------------------------------------
# Building the splits from the configuration


def _blends(d) -> list[tuple[str, list[str]]]:
    if d.train_data_path:
        return [(f"--{name}-data-path", getattr(d, f"{name}_data_path")) for name in SPLIT_NAMES]
    if d.data_args_path:
        return [(f"--data-args-path {d.data_args_path}", read_data_args(d.data_args_path))]
    return [("--data-path", d.data_path)]


def uses_raw_text(d) -> bool:
    """Whether the run's corpus is raw text; refuses a blend mixing raw text with indexed prefixes."""
    found = False
    for flag, words in _blends(d):
        if not words:
            continue
        paths = parse_data_path(words, flag)[0]
        raw = [p for p in paths if is_raw_text(p)]
        if raw and len(raw) < len(paths):
            indexed = next(p for p in paths if not is_raw_text(p))
            raise DataError(f"{flag} mixes raw text ({raw[0]}) with the indexed prefix {indexed}: a blend is all raw "
                            f"or all .bin/.idx; preprocess {raw[0]} with tools/preprocess_data.py or give only raw text")
        found = found or bool(raw)
    return found


def build_datasets(config, num_samples: tuple[int, int, int], workers: int):
    """(train, valid, test) RawTextDatasets for the run; the train one is registered for checkpoints."""
    d, m = config.data, config.model
    chunk_bytes = max(1, int(d.raw_text_chunk_mib * 2**20))
    tokenizer = TokenizerSpec(d.tokenizer_type, d.tokenizer_model, m.vocab_size)
    key = d.json_keys[0]

    def make(paths, weights, chunk_lists, n):
        for path, chunks in zip(paths, chunk_lists):
            check_source(path, chunks, key)
        return RawTextDataset(list(zip(paths, chunk_lists)), weights, n, m.seq_length, config.training.seed, key,
                              tokenizer, workers, d.skip_bad_records)

    results = []
    blends = _blends(d)
    if d.train_data_path:
        for (flag, words), n in zip(blends, num_samples):
            if not words or n == 0:
                results.append(None)
                continue
            paths, weights = parse_data_path(words, flag)
            results.append(make(paths, weights, [list_chunks(p, chunk_bytes) for p in paths], n))
    else:
        (flag, words), = blends
        paths, weights = parse_data_path(words, flag)
        shares = parse_split(d.split)
        chunk_lists = [list_chunks(p, chunk_bytes) for p in paths]
        for i, (name, n) in enumerate(zip(SPLIT_NAMES, num_samples)):
            if shares[i] == 0 or n == 0:
                results.append(None)
                continue
            parts = []
            for path, chunks in zip(paths, chunk_lists):
                begin, end = split_ranges(len(chunks), shares)[i]
                if begin == end:
                    raise DataError(f"the {name} split of {path} gets none of its {len(chunks)} chunks, but {n} "
                                    f"{name} samples are needed; raise its share in --split {d.split!r}, set it to 0, "
                                    f"or give the splits their own corpora (--train-data-path, --valid-data-path)")
                parts.append(chunks[begin:end])
            results.append(make(paths, weights, parts, n))
    if results[0] is not None:
        register(config, results[0])
    return tuple(results)

