"""Builds the train/valid/test datasets from --data-path, --split, --seq-length and --seed.

Each prefix's documents are cut into three contiguous ranges by --split (Megatron's rounding,
so the same flags pick the same documents as Megatron-LM). One prefix gives a GPTDataset per
split; several give a BlendedDataset per split over one GPTDataset per prefix, weighted by
the given weights or, without weights, by each prefix's number of tokens in that split.
"""

import os

import numpy as np

from megatron_lite.data.blended_dataset import BlendedDataset, build_blending_indices, normalize_weights
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.index_cache import default_cache_dir, load_or_build
from megatron_lite.data.indexed_dataset import IndexedDataset, bin_path
from megatron_lite.errors import DataError
from megatron_lite.validation import ConfigError

SPLIT_NAMES = ("train", "valid", "test")


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """(prefixes, weights) from ["P"], ["P1", "P2"] or ["W1", "P1", "W2", "P2"]."""
    if not data_path:
        raise ConfigError("--data-path is empty; give PREFIX or WEIGHT PREFIX pairs (or use --mock-data)")
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path), None
    if len(data_path) % 2:
        raise ConfigError(f"--data-path {' '.join(data_path)}: weights and prefixes must come in "
                          f"WEIGHT PREFIX pairs")
    weights = []
    for w in data_path[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            raise ConfigError(f"--data-path weight {w!r} is not a number; use WEIGHT PREFIX pairs") from None
    normalize_weights(weights)
    return list(data_path[1::2]), weights


def parse_split(split: str) -> list[float]:
    """Normalised train/valid/test shares from "969,30,1" (or "98/2/0"; missing shares are 0)."""
    try:
        shares = [float(s) for s in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {split!r} must be up to three numbers like 969,30,1") from None
    if len(shares) > 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ConfigError(f"--split {split!r} must be up to three non-negative numbers with a positive sum")
    shares += [0.0] * (3 - len(shares))
    return [s / sum(shares) for s in shares]


def split_ranges(num_documents: int, shares: list[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges for the shares, rounded the way Megatron-LM rounds them."""
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * float(num_documents))))
    excess = bounds[-1] - num_documents
    bounds = [0] + [max(0, b - excess) for b in bounds[1:]]
    return list(zip(bounds[:-1], bounds[1:]))


def build_train_valid_test_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                                    num_samples: tuple[int, int, int], cache_dir: str | None = None, *,
                                    vocab_size: int):
    """(train, valid, test): each yields >= num_samples[i] samples of seq_length + 1 tokens, or is None
    when its --split share is 0 or no samples are asked of it.

    Every token id must be below `vocab_size` (the model's vocabulary, unpadded); each dataset is
    checked on first use and the result cached, so that data made with another tokenizer fails here.
    """
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three non-negative counts, got {num_samples}")
    prefixes, weights = parse_data_path(data_path)
    shares = parse_split(split)
    indexed = [IndexedDataset(prefix) for prefix in prefixes]
    for ds in indexed:
        if ds.num_tokens == 0:
            raise DataError(f"data prefix {ds.prefix} holds no tokens ({len(ds)} sequences); "
                            f"preprocess a corpus with text in it")
        check_token_ids(ds, vocab_size, cache_dir or default_cache_dir(ds.prefix))
    ranges = [split_ranges(len(ds), shares) for ds in indexed]
    results = []
    for i, name in enumerate(SPLIT_NAMES):
        if shares[i] == 0 or num_samples[i] == 0:
            results.append(None)
            continue
        for ds, r in zip(indexed, ranges):
            if r[i][0] == r[i][1]:
                raise DataError(f"the {name} split of {ds.prefix} gets no documents of its {len(ds)}, but "
                                f"{num_samples[i]} {name} samples are needed; raise its share in "
                                f"--split {split!r} or set the share to 0")

        def make(k, n, i=i, name=name):
            return GPTDataset(indexed[k], ranges[k][i], n, seq_length, seed, cache_dir, split_name=name)

        if len(indexed) == 1:
            results.append(make(0, num_samples[i]))
            continue
        split_weights = weights or [
            int(ds.sequence_lengths[slice(*r[i])].sum(dtype=np.int64)) for ds, r in zip(indexed, ranges)]
        blend = _blending_indices(split_weights, num_samples[i], cache_dir or default_cache_dir(prefixes[0]))
        counts = np.bincount(blend["dataset_index"], minlength=len(indexed))
        components = [make(k, int(counts[k])) for k in range(len(indexed))]
        results.append(BlendedDataset(components, blend["dataset_index"], blend["dataset_sample_index"]))
    return tuple(results)


def check_token_ids(dataset: IndexedDataset, vocab_size: int, cache_dir: str) -> None:
    """Raise DataError if a token id of `dataset` lies outside 0 .. vocab_size - 1.

    An id past the vocabulary indexes beyond the embedding (an IndexError on one rank, an infinite
    loss under tensor parallelism); a negative one means the .idx dtype is not the .bin's. The scan
    reads the whole .bin once; its result is cached with the dataset's indices, keyed by the file's
    size and modification time, so later runs and the other ranks only read the cache.
    """
    path = bin_path(dataset.prefix)
    stat = os.stat(path)
    description = {"class": "TokenIdRange", "dataset_path": os.path.abspath(path), "dtype": str(dataset.dtype),
                   "bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns}
    token_range = load_or_build(cache_dir, description,
                                lambda: {"token_id_range": np.array(dataset.token_id_range(), dtype=np.int64)})
    smallest, largest = (int(v) for v in token_range["token_id_range"])
    if smallest < 0:
        raise DataError(f"{path} holds a negative token id ({smallest}): it was not written as the "
                        f"{dataset.dtype} tokens its .idx declares; rerun tools/preprocess_data.py")
    if largest >= vocab_size:
        raise DataError(f"{path} holds token id {largest}, but the model's vocabulary has {vocab_size} ids "
                        f"(0..{vocab_size - 1}); train with the tokenizer the data was made with "
                        f"(--tokenizer-type/--tokenizer-model), or preprocess the data again with this one")


def _blending_indices(weights: list[float], size: int, cache_dir: str) -> dict[str, np.ndarray]:
    """Blending indices, cached so that one process sorts and the others map the result."""
    description = {"class": "BlendedDataset", "weights": normalize_weights(weights).tolist(), "size": size}

    def build():
        dataset_index, dataset_sample_index = build_blending_indices(weights, size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    return load_or_build(cache_dir, description, build)
