"""Training straight from raw text: --data-path (or --train-data-path ...) entries that are JSON lines,
Parquet or saved datasets are read, tokenized and packed while training runs.

The global sample sequence is a function of the sources, weights, --seed, --seq-length and tokenizer alone:
one source's samples are its stream's (raw_text_stream.py); a blend takes global sample i from source
dataset_index[i] by Megatron's greedy rule, the one the indexed BlendedDataset uses (blended_dataset.py).
Every data-parallel rank reads the whole global stream and keeps the samples the PretrainingSampler gives
it, a whole step of micro_batch_size x dp samples at a time, so after a global batch of c consumed samples
the stream stands at sample c on every rank, whatever the layout. The position of every source there is
handed to the checkpoint (`RawTextDataset.loader_state`, kept in metadata.json) and a resume starts from
it (`restore_loader_state`), at any DP/TP/PP/CP size and under ramp-up. Without a saved position (a validation
stream) the stream is read from the start up to the consumed samples: the same samples, later.

--split cuts each source's chunks at the rounded cumulative shares, as the indexed path cuts documents.
A blend that mixes raw text with .bin/.idx prefixes is refused: preprocess the raw part, or give only raw text.
"""

from __future__ import annotations

import dataclasses
import math

import torch.distributed as dist

from megatron_lite.data.blended_dataset import build_blending_indices, normalize_weights
from megatron_lite.data.builder import SPLIT_NAMES, parse_data_path, parse_split, read_data_args, split_ranges
from megatron_lite.data.raw_text_sources import check_source, is_raw_text, list_chunks
from megatron_lite.data.raw_text_stream import Position, SourceStream, TokenizedChunks, TokenizerSpec
from megatron_lite.errors import DataError


def log_on_first_rank(message: str) -> None:
    """Print a data line once per job (on global rank 0), or in a process without a group."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class RawTextDataset:
    """`num_samples` samples of seq_length + 1 tokens from raw-text sources blended by `weights`."""

    def __init__(self, sources: list[tuple[str, list]], weights: list[float] | None, num_samples: int,
                 seq_length: int, seed: int, key: str, tokenizer: TokenizerSpec, workers: int, skip_bad_records: int):
        self.names = [name for name, _ in sources]
        self.chunk_datasets = [TokenizedChunks(k, chunks, key, seed, tokenizer)
                               for k, (_, chunks) in enumerate(sources)]
        self.num_samples, self.seq_length = num_samples, seq_length
        self.workers, self.skip_bad_records = workers, skip_bad_records
        self.dataset_index = None
        if len(sources) > 1:
            weights = normalize_weights(weights).tolist()
            size = sum(math.ceil(num_samples * w) for w in weights)  # the indexed blend's size
            self.dataset_index = build_blending_indices(weights, size)[0]
        self.positions: dict[int, list[Position]] = {}  # consumed samples -> every source's position
        self.resume: tuple[int, list[Position]] | None = None
        self.streams: list[SourceStream] = []

    def __len__(self) -> int:
        return self.num_samples

    def samples(self, start: int):
        """The global samples from `start` on, as (index, tokens); `streams` are the sources' streams."""
        if self.resume is not None and self.resume[0] == start:
            positions, ahead = self.resume[1], 0
        else:
            positions, ahead = [Position() for _ in self.names], start
        self.streams = [SourceStream(ds, name, self.seq_length, p, self.workers, self.skip_bad_records, log_on_first_rank)
                        for ds, name, p in zip(self.chunk_datasets, self.names, positions)]
        for i in range(start - ahead, self.num_samples):
            sample = self.streams[0 if self.dataset_index is None else int(self.dataset_index[i])].next_sample()
            if i >= start:
                yield i, sample

    def loader_tokens_per_sec(self) -> float:
        """What the loader can tokenize per second: the tokens its workers have read and tokenized so far per
        second they spent on it, times its worker processes (--num-workers per source; the main process when
        0), to set against the tokens/s training consumes (every data-parallel rank reads the whole stream)."""
        tokens = sum(s.tokens for s in self.streams)
        seconds = sum(s.worker_seconds for s in self.streams)
        return tokens / seconds * max(self.workers, 1) * len(self.streams) if seconds else 0.0

    def loader_state(self, consumed_samples: int) -> dict | None:
        """Every source's position at `consumed_samples` (after a step this rank has read), as JSON values for
        the checkpoint's metadata.json; None when the stream has not stood there."""
        if consumed_samples not in self.positions:
            return None
        return {"consumed_samples": consumed_samples, "sources": self.names,
                "positions": [dataclasses.asdict(p) for p in self.positions[consumed_samples]]}

    def restore_loader_state(self, state: dict | None, consumed_samples: int) -> None:
        """Start the stream at `consumed_samples` from the positions a checkpoint's `state` holds; without a
        state for these sources at that point, the stream is read from its start up to there (and the log
        says so)."""
        if state is not None and not isinstance(state, dict):
            raise DataError(f"the checkpoint's data_loader is {str(state)[:60]}, not an object; remove "
                            f"'data_loader' from its metadata.json to re-read the stream")
        if state is None or state.get("consumed_samples") != consumed_samples or state.get("sources") != self.names:
            if consumed_samples:
                log_on_first_rank(f" raw text loader: the checkpoint holds no position of {', '.join(self.names)} at "
                     f"{consumed_samples} samples; reading the stream from its start up to there")
            return
        saved = state.get("positions")
        if not isinstance(saved, list) or len(saved) != len(self.names):
            raise DataError(f"the checkpoint's data_loader holds {str(saved)[:60]} as the positions of the "
                            f"{len(self.names)} sources {', '.join(self.names)}, not one per source; remove "
                            f"'data_loader' from its metadata.json to re-read the stream")
        self.resume = (consumed_samples, [_position_of(p) for p in saved])


def _position_of(saved) -> Position:
    fields = [f.name for f in dataclasses.fields(Position)]
    if not (isinstance(saved, dict) and sorted(saved) == sorted(fields)
            and all(type(saved[name]) is int and saved[name] >= 0 for name in fields)):
        raise DataError(f"the checkpoint's data_loader position {str(saved)[:80]} is not {{{', '.join(fields)}}} "
                        f"of non-negative integers; remove 'data_loader' from its metadata.json to re-read the stream")
    return Position(**saved)


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
        for i, sample in samples:
            if i in wanted:
                kept.append(sample)
            if i == start + sampler.step - 1:
                break
        dataset.positions[start + sampler.step] = [s.position() for s in dataset.streams]
        for old in sorted(dataset.positions)[:-4]:  # a save asks for the latest only
            del dataset.positions[old]
        batch, kept = collate(kept), []
        yield batch


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
            raise DataError(f"{flag} mixes raw text ({raw[0]}) with the indexed prefix {indexed}: a blend is all "
                            f"raw or all .bin/.idx; preprocess {raw[0]} with tools/preprocess_data.py or give only "
                            f"raw text")
        found = found or bool(raw)
    return found


def build_datasets(config, num_samples: tuple[int, int, int], workers: int):
    """(train, valid, test) RawTextDatasets for the run (None for a split that reads no samples)."""
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
    return tuple(results)

