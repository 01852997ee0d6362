"""SFTDataset: one training sample of seq_length tokens per row of conversations, packed as Megatron's SFTDataset
packs them (megatron/training/datasets/sft_dataset.py).

Sample i is row begin + (i mod rows) of the split, in file order (Megatron shuffles SFT data only by its blend:
shuffle the file to mix it). The row's conversations are laid end to end; under context parallelism each is
padded to a multiple of 2 x cp tokens, the granularity of the load-balanced split; the pack is padded to
seq_length + 1 tokens, the padding continuing the positions and the document of the conversation before it. A
pack that reaches seq_length + 1 tokens is cut to seq_length and one padding token (Megatron's rule, so a
conversation of exactly seq_length + 1 tokens loses its last); the conversations after it in the row are left
out. With `long_conversations="drop"` a conversation that would be cut is left out instead, and the next one
tried.

Each conversation is its own document: positions restart at 0 and attention stays within it (document_ids, as
--reset-attention-mask gives); an end-of-turn token inside a conversation is no boundary. The loss mask keeps
the positions whose label is an assistant token of the same conversation: padding, prompts and the step from one
conversation into the next are not learnt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_lite.data.sft.tokenized import TokenizedConversations


@dataclass
class PackCounts:
    """What packing the rows of a split cuts and leaves out."""

    truncated: int = 0
    dropped: int = 0


class SFTDataset:
    """`num_samples` packed samples of the rows [begin, end) of `conversations`."""

    def __init__(self, conversations: TokenizedConversations, row_range: tuple[int, int], num_samples: int,
                 seq_length: int, pad: int, cp_size: int = 1, long_conversations: str = "truncate"):
        if row_range[1] <= row_range[0]:
            raise ValueError(f"an SFT split needs rows, got {row_range}")
        self.conversations = conversations
        self.rows = np.arange(*row_range, dtype=np.int64)
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.pad = pad
        self.granularity = 2 * cp_size if cp_size > 1 else 1
        self.drop = long_conversations == "drop"
        self.counts = PackCounts()
        for row in self.rows:
            self._plan(conversations.conversation_lengths(int(row)), self.counts)

    def __len__(self) -> int:
        return self.num_samples

    def _padded(self, length: int) -> int:
        return -(-length // self.granularity) * self.granularity

    def _plan(self, lengths: np.ndarray, counts: PackCounts | None = None) -> list[tuple[int, int]]:
        """(conversation of the row, tokens kept) in packing order."""
        plan, used, capacity = [], 0, self.seq_length + 1
        for k, length in enumerate(int(n) for n in lengths):
            padded = self._padded(length)
            if used + padded < capacity:
                plan.append((k, length))
                used += padded
                continue
            if self.drop:
                if counts is not None:
                    counts.dropped += 1
                continue
            plan.append((k, min(length, self.seq_length - used)))
            if counts is not None:
                counts.truncated += 1
            break
        return plan

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        """tokens, labels, loss_mask, position_ids and document_ids, each [seq_length]."""
        row = int(self.rows[i % len(self.rows)])
        conversations = self.conversations.row(row)
        capacity = self.seq_length + 1
        tokens = np.full(capacity, self.pad, dtype=np.int64)
        learnt = np.zeros(capacity, dtype=bool)  # an assistant token
        documents = np.zeros(capacity, dtype=np.int64)
        positions = np.zeros(capacity, dtype=np.int64)
        used = 0
        for document, (k, kept) in enumerate(self._plan(self.conversations.conversation_lengths(row))):
            ids, mask = conversations[k]
            end = min(used + self._padded(kept), capacity)
            tokens[used:used + kept] = ids[:kept]
            learnt[used:used + kept] = mask[:kept].astype(bool)
            documents[used:] = document
            positions[used:] = np.arange(capacity - used)
            used = end
        same_document = documents[1:] == documents[:-1]
        return {"tokens": tokens[:-1], "labels": tokens[1:],
                "loss_mask": (learnt[1:] & same_document).astype(np.float32),
                "position_ids": positions[:-1], "document_ids": documents[:-1]}
