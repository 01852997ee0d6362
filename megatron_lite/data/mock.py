"""Deterministic synthetic token sequences, so that training runs with no corpus (`--mock-data`).

Sample i is an arithmetic progression modulo the vocabulary with a start and stride drawn from a
generator seeded by (seed, i): a model can learn it (the loss falls well below log(vocab)), and every
rank and every run sees the same tokens for the same index.

Documents: the end-of-document id of mock data is vocab_size - 1, as NullTokenizer's. A progression passes
through it every vocab_size / gcd(stride, vocab_size) tokens, or never, so each occurrence ends a "document"
and a small vocabulary gives samples that pack several: enough to exercise --reset-position-ids,
--reset-attention-mask and --eod-mask-loss with --mock-data.
"""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """`num_samples` samples of seq_length + 1 tokens each (inputs and shifted labels)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.eod = vocab_size - 1

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} outside a mock dataset of {self.num_samples}")
        rng = np.random.default_rng([self.seed, index])
        start = int(rng.integers(0, self.vocab_size))
        stride = int(rng.integers(1, 4))
        return (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
