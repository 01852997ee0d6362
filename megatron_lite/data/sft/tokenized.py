"""The tokenized form of a conversations file: every conversation's tokens and assistant mask, grouped by row.

On disk it is two of Megatron's indexed datasets side by side: PREFIX.bin/.idx holds the tokens (a sequence per
conversation, a document per row) and PREFIX_assistant_mask.bin/.idx the masks (uint8, the same shape).
`tools/preprocess_data.py --sft` writes them once for a large set. Training from the conversations file itself
builds the same arrays at start-up in the dataset cache (one process builds while the others wait and then map
them), so the two forms give the same samples.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from megatron_lite.data.index_cache import load_or_build
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, idx_path, smallest_dtype
from megatron_lite.data.sft.chat_tokenizer import ChatTokenizer
from megatron_lite.data.sft.conversations import ReadCounts, read_conversations
from megatron_lite.errors import DataError

MASK_SUFFIX = "_assistant_mask"


@dataclass
class TokenizedConversations:
    """Conversation c holds tokens[starts[c]:starts[c + 1]] (and the mask alike); row r holds conversations
    rows[r] .. rows[r + 1] - 1."""

    tokens: np.ndarray
    assistant_mask: np.ndarray
    starts: np.ndarray
    rows: np.ndarray
    source: str
    counts: ReadCounts

    def __len__(self) -> int:
        return len(self.rows) - 1

    def conversation_lengths(self, row: int) -> np.ndarray:
        return np.diff(self.starts[self.rows[row]:self.rows[row + 1] + 1])

    def row(self, row: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(tokens, assistant mask) of each conversation of `row`."""
        return [(self.tokens[self.starts[c]:self.starts[c + 1]], self.assistant_mask[self.starts[c]:self.starts[c + 1]])
                for c in range(int(self.rows[row]), int(self.rows[row + 1]))]


def tokenize_file(path: str, chat: ChatTokenizer) -> tuple[dict[str, np.ndarray], ReadCounts]:
    """The arrays of every conversation of `path`, and what reading it left out."""
    counts = ReadCounts()
    tokens, masks, lengths, rows = [], [], [], [0]
    for where, conversations in read_conversations(path, counts):
        for k, conversation in enumerate(conversations):
            ids, mask = chat.tokenize(conversation, f"{where} (conversation {k + 1})")
            tokens.append(ids)
            masks.append(mask)
            lengths.append(len(ids))
        rows.append(len(lengths))
    if not lengths:
        raise DataError(f"SFT data {path} holds no conversation with an assistant turn ({counts.rows} rows read); "
                        f"SFT learns the assistant's turns")
    return {"tokens": np.concatenate(tokens).astype(np.int32), "assistant_mask": np.concatenate(masks).astype(np.uint8),
            "starts": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "rows": np.asarray(rows, dtype=np.int64),
            "counts": np.asarray([counts.rows, counts.conversations, counts.without_assistant,
                                  counts.skipped_rows], dtype=np.int64)}, counts


def load_conversations(path: str, chat: ChatTokenizer, cache_dir: str) -> TokenizedConversations:
    """A conversations file tokenized, through the dataset cache (keyed by the file, the tokenizer and template)."""
    tokenizer_file = os.path.join(chat.tokenizer.name_or_path, "tokenizer.json")
    description = {"class": "SFTConversations", "dataset_path": os.path.abspath(path), "files": _files_of(path),
                   "template_md5": hashlib.md5(chat.template.encode()).hexdigest(),
                   "tokenizer_md5": _md5(tokenizer_file)}
    arrays = load_or_build(cache_dir, description, lambda: tokenize_file(path, chat)[0])
    rows, conversations, without_assistant, skipped_rows = (int(v) for v in arrays["counts"])
    counts = ReadCounts(rows, conversations, without_assistant, skipped_rows)
    return TokenizedConversations(arrays["tokens"], arrays["assistant_mask"], arrays["starts"], arrays["rows"],
                                  path, counts)


def _files_of(path: str) -> list[list]:
    """(name, bytes, modification time) of the file, or of every file of a saved dataset's folder: what the cached
    tokens were made from."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names)
    return [[os.path.relpath(f, path) if f != path else "", os.stat(f).st_size, os.stat(f).st_mtime_ns]
            for f in files]


def _md5(path: str) -> str:
    with open(path, "rb") as file:
        return hashlib.md5(file.read()).hexdigest()


def write_prefix(arrays: dict[str, np.ndarray], prefix: str, vocab_size: int) -> None:
    """The tokenized arrays as PREFIX.bin/.idx and PREFIX_assistant_mask.bin/.idx (nothing left on failure)."""
    builders = [IndexedDatasetBuilder(prefix, smallest_dtype(vocab_size)),
                IndexedDatasetBuilder(prefix + MASK_SUFFIX, np.uint8)]
    try:
        rows, starts = arrays["rows"], arrays["starts"]
        for builder, name in zip(builders, ("tokens", "assistant_mask")):
            values = arrays[name]
            for r in range(len(rows) - 1):
                builder.add_row([values[starts[c]:starts[c + 1]] for c in range(rows[r], rows[r + 1])])
        for builder in builders:
            builder.finalize()
    except BaseException:
        for builder in builders:
            builder.abort()
        raise


def is_tokenized_prefix(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(idx_path(prefix + MASK_SUFFIX))


def open_prefix(prefix: str, mmap_bin: bool = True) -> TokenizedConversations:
    """The tokenized form written by tools/preprocess_data.py --sft."""
    if not os.path.isfile(idx_path(prefix + MASK_SUFFIX)):
        raise DataError(f"{prefix}: {idx_path(prefix + MASK_SUFFIX)} not found; --sft reads a conversations file "
                        f"or a prefix made by tools/preprocess_data.py --sft (tokens and assistant masks)")
    tokens, masks = IndexedDataset(prefix, mmap_bin), IndexedDataset(prefix + MASK_SUFFIX, mmap_bin)
    if not (np.array_equal(tokens.sequence_lengths, masks.sequence_lengths)
            and np.array_equal(tokens.document_indices, masks.document_indices)):
        raise DataError(f"{prefix}: the tokens and the assistant masks ({prefix + MASK_SUFFIX}) do not have the same "
                        f"conversations; write both again with tools/preprocess_data.py --sft")
    starts = np.concatenate([[0], np.cumsum(tokens.sequence_lengths, dtype=np.int64)])
    counts = ReadCounts(len(tokens.document_indices) - 1, len(tokens))
    return TokenizedConversations(tokens.get(0, 0, tokens.num_tokens) if len(tokens) else np.zeros(0, np.int32),
                                  masks.get(0, 0, masks.num_tokens) if len(masks) else np.zeros(0, np.uint8),
                                  starts, np.asarray(tokens.document_indices), prefix, counts)
