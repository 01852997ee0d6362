"""The sample stream of raw-text sources: documents in a seeded order, tokenized in loader workers, packed.

One source's token stream, epoch after epoch:
- the chunks (raw_text_sources.py) in the order RandomState([seed, source, epoch]).permutation(chunks):
  a shuffle over the whole source that needs only its file sizes and metadata;
- within a chunk, its documents (non-empty texts) in the order RandomState([seed, source, epoch, chunk,
  1]).permutation(documents): a shuffle within a bounded buffer;
- each document's tokens followed by the tokenizer's end-of-document token.
Sample j of a source is tokens [j s, j s + s + 1) of that stream (s = --seq-length): consecutive samples
share one token, as in Megatron's GPTDataset. A new epoch draws new orders, and the log says so.

Reading and tokenizing run in the processes of a torch DataLoader (--num-workers), a chunk per task, at
most 2 chunks per worker ahead (the bounded prefetch); the packing runs where the samples are used.

The position of a source is (epoch, chunk position, document, token offset) of the first token of its
next sample, with the count of bad records skipped so far: a few integers from which the stream goes on
exactly as it would have.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import torch

from megatron_lite.data.raw_text_sources import BadRecord, Chunk, read_chunk
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.errors import DataError

PREFETCH_CHUNKS_PER_WORKER = 2


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """What builds the tokenizer in each worker process (a tokenizer object need not be picklable)."""

    tokenizer_type: str
    tokenizer_model: str | None
    vocab_size: int | None

    def build(self):
        return build_tokenizer(self.tokenizer_type, self.tokenizer_model, self.vocab_size)


def chunk_order(seed: int, source: int, epoch: int, num_chunks: int) -> np.ndarray:
    return np.random.RandomState([seed, source, epoch]).permutation(num_chunks)


def document_order(seed: int, source: int, epoch: int, chunk: int, num_documents: int) -> np.ndarray:
    return np.random.RandomState([seed, source, epoch, chunk, 1]).permutation(num_documents)


class TokenizedChunks(torch.utils.data.Dataset):
    """Item (epoch, position): the documents of the chunk at `position` of the epoch's chunk order, in their
    shuffled order, each as int64 tokens ending in the end-of-document token; with the bad records met."""

    def __init__(self, source: int, chunks: list[Chunk], key: str, seed: int, tokenizer: TokenizerSpec):
        self.source, self.chunks, self.key, self.seed, self.tokenizer_spec = source, chunks, key, seed, tokenizer
        self._tokenizer = None

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, item: tuple[int, int]) -> dict:
        """A DataError comes back as the item's "error": raised in a worker, the DataLoader would re-raise it
        with the worker's traceback in its message."""
        try:
            return self._read(*item)
        except DataError as error:
            return {"error": str(error)}

    def _read(self, epoch: int, position: int) -> dict:
        start = time.perf_counter()
        if self._tokenizer is None:
            self._tokenizer = self.tokenizer_spec.build()
        chunk_id = int(chunk_order(self.seed, self.source, epoch, len(self.chunks))[position])
        texts, bad = [], []
        for record in read_chunk(self.chunks[chunk_id], self.key):
            if isinstance(record, BadRecord):
                bad.append(str(record))
            elif record:
                texts.append(record)
        eod = [self._tokenizer.eod]
        documents = [np.asarray(self._tokenizer.tokenize(texts[i]) + eod, dtype=np.int64)
                     for i in document_order(self.seed, self.source, epoch, chunk_id, len(texts))]
        return {"epoch": epoch, "position": position, "documents": documents, "bad": bad,
                "tokens": sum(len(d) for d in documents), "seconds": time.perf_counter() - start}


def _as_is(item):
    return item


class _ChunkRequests(torch.utils.data.Sampler):
    """(epoch, position) of every chunk from a starting one on, epoch after epoch, without end."""

    def __init__(self, num_chunks: int, epoch: int, position: int):
        self.num_chunks, self.epoch, self.position = num_chunks, epoch, position

    def __iter__(self):
        epoch, position = self.epoch, self.position
        while True:
            yield epoch, position
            position += 1
            if position == self.num_chunks:
                epoch, position = epoch + 1, 0


@dataclasses.dataclass
class Position:
    """Where a source's next sample starts, and how many bad records it has skipped."""

    epoch: int = 0
    chunk: int = 0
    document: int = 0
    offset: int = 0
    bad_records: int = 0


class SourceStream:
    """The samples of one source from `position` on; `report` receives (message) lines for the log."""

    def __init__(self, dataset: TokenizedChunks, name: str, seq_length: int, position: Position, workers: int,
                 skip_bad_records: int, report):
        self.name, self.seq_length, self.skip_bad_records, self.report = name, seq_length, skip_bad_records, report
        self.bad_records = position.bad_records
        loader = torch.utils.data.DataLoader(
            dataset, sampler=_ChunkRequests(len(dataset), position.epoch, position.chunk), batch_size=None,
            collate_fn=_as_is, num_workers=workers, prefetch_factor=PREFETCH_CHUNKS_PER_WORKER if workers else None)
        self.chunks = iter(loader)
        self.pending: collections.deque = collections.deque()  # (epoch, chunk position, document, tokens)
        self.offset = position.offset
        self.tokens = 0
        self.worker_seconds = 0.0
        self.epoch = position.epoch
        self.documents_this_epoch = int(position.chunk > 0 or position.document > 0)  # unknown when resumed mid-epoch
        self._fill(skip_documents=position.document)

    def _fill(self, skip_documents: int = 0) -> None:
        """Append the next chunk's documents (the first chunk's from document `skip_documents` on)."""
        while True:
            chunk = next(self.chunks)
            if "error" in chunk:
                raise DataError(chunk["error"])
            self.tokens += chunk["tokens"]
            self.worker_seconds += chunk["seconds"]
            self._count_bad(chunk["bad"])
            if chunk["epoch"] > self.epoch:
                if self.documents_this_epoch == 0:
                    raise DataError(f"raw text source {self.name} gave no documents in a whole epoch")
                self.epoch, self.documents_this_epoch = chunk["epoch"], 0
                self.report(f" raw text {self.name}: epoch {chunk['epoch'] + 1} begins, reshuffled")
            self.documents_this_epoch += len(chunk["documents"])
            documents = list(enumerate(chunk["documents"]))[skip_documents:]
            skip_documents = 0
            self.pending.extend((chunk["epoch"], chunk["position"], i, d) for i, d in documents)
            if documents:
                return

    def _count_bad(self, bad: list[str]) -> None:
        if not bad:
            return
        if self.skip_bad_records == 0:
            raise DataError(f"{bad[0]}; fix or remove the record, or pass --skip-bad-records N to skip up to N")
        self.bad_records += len(bad)
        if self.bad_records > self.skip_bad_records:
            raise DataError(f"{self.bad_records} bad records, more than --skip-bad-records {self.skip_bad_records}; "
                            f"the last: {bad[-1]}")
        for record in bad:
            self.report(f" skipped bad record {record} ({self.bad_records} of --skip-bad-records "
                        f"{self.skip_bad_records})")

    def next_sample(self) -> np.ndarray:
        """seq_length + 1 tokens from the position; the position moves on by seq_length."""
        need, parts, index, offset = self.seq_length + 1, [], 0, self.offset
        while need:
            if index == len(self.pending):
                self._fill()
            tokens = self.pending[index][3][offset:offset + need]
            parts.append(tokens)
            need -= len(tokens)
            index, offset = index + 1, 0
        advance = self.seq_length
        while advance >= len(self.pending[0][3]) - self.offset:
            advance -= len(self.pending[0][3]) - self.offset
            self.pending.popleft()
            self.offset = 0
        self.offset += advance
        return np.concatenate(parts)

    def position(self) -> Position:
        epoch, chunk, document, _ = self.pending[0]
        return Position(epoch, chunk, document, self.offset, self.bad_records)
