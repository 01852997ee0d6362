"""GPTDataset: fixed-length training samples cut from a stream of shuffled documents.

The three index arrays are Megatron-Core's (megatron/core/datasets/gpt_dataset.py,
`_build_document_sample_shuffle_indices`), so the same corpus, split, sample count, sequence length and
seed give the same samples in the same order as Megatron-LM:

- document_index: the split's documents once per epoch, for as many epochs as the requested samples
  need, all copies shuffled together by one permutation (documents of different epochs mix);
- sample_index[j] = (position in document_index, token offset) where sample j starts; sample j
  spans the token stream from sample_index[j] to sample_index[j + 1] inclusive, i.e.
  seq_length + 1 tokens, crossing document boundaries (the eod tokens separate documents);
- shuffle_index: a permutation of the samples, so consecutive samples come from far apart.

Consecutive samples share one token (the last label of one is the first input of the next),
so one epoch of T tokens gives (T - 1) // seq_length samples and every token but the final
remainder is an input exactly once. When the last epoch is needed only in small part (fewer than
int(0.8 x samples per epoch) of its samples), it is kept apart ("separate final epoch"): the first
epochs' document copies are shuffled together and the last epoch's on their own, and the samples of
the first epochs are shuffled among themselves and come first, so they cover whole epochs evenly.
"""

import os

import numpy as np

from megatron_lite.data.index_cache import default_cache_dir, load_or_build
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.errors import DataError

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80
_INDICES = ("document_index", "sample_index", "shuffle_index")


class GPTDataset:
    """Samples of seq_length + 1 tokens (int64) from documents [begin, end) of `indexed_dataset`.

    Indices are cached under `cache_dir` (default: `cache/` beside the dataset).
    """

    def __init__(self, indexed_dataset: IndexedDataset, document_range: tuple[int, int], num_samples: int,
                 seq_length: int, seed: int, cache_dir: str | None = None, split_name: str = "train"):
        if seq_length < 1:
            raise ValueError(f"seq-length must be >= 1 (got {seq_length})")
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        document_ids = np.arange(*document_range, dtype=np.int64)
        tokens_per_epoch = int(indexed_dataset.sequence_lengths[document_ids].sum(dtype=np.int64))
        if tokens_per_epoch < seq_length + 1:
            raise DataError(f"the {split_name} split of {indexed_dataset.prefix} has {tokens_per_epoch} "
                            f"tokens, fewer than seq-length + 1 = {seq_length + 1}; give it a larger "
                            f"share in --split, add data, or lower --seq-length")
        description = {
            "class": "GPTDataset",
            "dataset_path": os.path.abspath(indexed_dataset.prefix),
            "dataset_sequences": len(indexed_dataset),
            "dataset_tokens": indexed_dataset.num_tokens,
            "split": split_name,
            "document_range": [int(document_range[0]), int(document_range[1])],
            "num_samples": int(num_samples),
            "seq_length": seq_length,
            "seed": seed,
        }
        indices = load_or_build(cache_dir or default_cache_dir(indexed_dataset.prefix), description,
                                lambda: build_indices(indexed_dataset.sequence_lengths, document_ids,
                                                      num_samples, seq_length, seed))
        self.document_index, self.sample_index, self.shuffle_index = (indices[name] for name in _INDICES)

    def __getstate__(self) -> dict:
        """Pickle the paths of the memory-mapped index files, not their contents."""
        return {**self.__dict__, **{name: getattr(self, name).filename for name in _INDICES}}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in _INDICES:
            setattr(self, name, np.load(state[name], mmap_mode="r"))

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        j = int(self.shuffle_index[i])
        first, first_offset = (int(v) for v in self.sample_index[j])
        last, last_offset = (int(v) for v in self.sample_index[j + 1])
        get = self.indexed_dataset.get
        if first == last:
            return get(int(self.document_index[first]), first_offset, last_offset - first_offset + 1
                       ).astype(np.int64)
        parts = [get(int(self.document_index[first]), first_offset)]
        parts += [get(int(self.document_index[k])) for k in range(first + 1, last)]
        parts.append(get(int(self.document_index[last]), 0, last_offset + 1))
        return np.concatenate(parts).astype(np.int64)


def build_indices(sequence_lengths: np.ndarray, document_ids: np.ndarray, num_samples: int,
                  seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """document_index, sample_index and shuffle_index for at least `num_samples` samples.

    One RandomState(seed) draws, in Megatron-Core's order, the document permutation(s) and then the
    sample permutation(s); a permutation of the same length consumes the same draws whatever the dtype,
    so the arrays equal Megatron's element for element.
    """
    rng = np.random.RandomState(seed)
    tokens_per_epoch = int(sequence_lengths[document_ids].sum(dtype=np.int64))
    # Megatron's _get_num_epochs: the fewest epochs holding num_samples * seq_length + 1 tokens
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    samples_per_epoch = (tokens_per_epoch - 1) // seq_length
    separate_final_epoch = (num_epochs > 1 and num_samples - samples_before_final
                            < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * samples_per_epoch))
    if separate_final_epoch:
        document_index = np.concatenate([_shuffled_copies(document_ids, num_epochs - 1, rng),
                                         _shuffled_copies(document_ids, 1, rng)])
    else:
        document_index = _shuffled_copies(document_ids, num_epochs, rng)
    sample_index = build_sample_index(sequence_lengths[document_index], seq_length)

    num_built = len(sample_index) - 1
    if separate_final_epoch:
        shuffle_index = np.concatenate([rng.permutation(samples_before_final),
                                        samples_before_final + rng.permutation(num_built - samples_before_final)])
    else:
        shuffle_index = rng.permutation(num_built)
    return {"document_index": document_index,
            "sample_index": sample_index,
            "shuffle_index": shuffle_index.astype(np.int64)}


def _shuffled_copies(document_ids: np.ndarray, copies: int, rng: np.random.RandomState) -> np.ndarray:
    """`copies` concatenated copies of the documents, shuffled as one array (Megatron's _build_document_index)."""
    document_index = np.tile(document_ids.astype(np.int64), copies)
    rng.shuffle(document_index)
    return document_index


def num_samples_per_epoch(sequence_lengths: np.ndarray, document_range: tuple[int, int], seq_length: int) -> int:
    """How many samples one epoch of documents [begin, end) holds: Megatron's length of a GPTDataset built
    for one epoch, the weight an unweighted blend gives it."""
    return (int(sequence_lengths[slice(*document_range)].sum(dtype=np.int64)) - 1) // seq_length


def build_sample_index(document_lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """[num_samples + 1, 2] rows of (position in the document order, token offset).

    Sample j starts at token j * seq_length of the concatenated documents, in the document that holds
    that token (a position that falls exactly on a document end points at the start of the next
    non-empty document); the first row is (0, 0) even when the first document is empty, as in
    Megatron's build_sample_idx (helpers.cpp).
    """
    ends = np.cumsum(document_lengths, dtype=np.int64)
    num_samples = (int(ends[-1]) - 1) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(ends, starts, side="right")
    position[0] = 0
    offset = starts - (ends[position] - document_lengths[position])
    return np.stack([position, offset], axis=1).astype(np.int64)
