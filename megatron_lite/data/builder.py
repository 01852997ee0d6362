"""Builds the train/valid/test datasets from --data-path (or --data-args-path) and --split, or from
--train-data-path/--valid-data-path/--test-data-path, with --seq-length and --seed.

Each step is Megatron-Core's (megatron/core/datasets/blended_megatron_dataset_builder.py), so the same
flags give the same samples as Megatron-LM:

- --split: each prefix's documents are cut into three contiguous ranges at round(c * documents) for
  the cumulative shares c (blended_megatron_dataset_config.convert_split_vector_to_split_matrix);
- one prefix without weights (or, with a blend per split, one prefix) gives a GPTDataset of the samples
  asked;
- weights (one prefix or several) give a BlendedDataset of sum_d ceil(n * w_d) samples, over one
  GPTDataset per prefix built for ceil(ceil(n * w_d) * 1.005) samples (_get_size_per_split_per_dataset
  with Megatron's default mid_level_dataset_surplus);
- several prefixes without weights: each GPTDataset holds one epoch and weighs its number of samples.
  Megatron then stops after one epoch of the whole blend (min(n, total)); here a component that the
  blend needs beyond its epoch gets more epochs, so n samples are always there.
"""

import math
import os

import numpy as np

from megatron_lite.data.blended_dataset import BlendedDataset, build_blending_indices, normalize_weights
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.index_cache import default_cache_dir, load_or_build
from megatron_lite.data.indexed_dataset import IndexedDataset, bin_path
from megatron_lite.errors import DataError
from megatron_lite.files import read_text
from megatron_lite.errors import ConfigError

SPLIT_NAMES = ("train", "valid", "test")
MID_LEVEL_DATASET_SURPLUS = 0.005  # Megatron's default: each component of a weighted blend is built 0.5% larger


def parse_data_path(data_path: list[str], flag: str = "--data-path") -> tuple[list[str], list[float] | None]:
    """(prefixes, weights) from ["P"], ["P1", "P2"] or ["W1", "P1", "W2", "P2"]; `flag` names the source
    of the list in errors."""
    if not data_path:
        raise ConfigError(f"{flag} is empty; give PREFIX or WEIGHT PREFIX pairs (or use --mock-data)")
    try:
        float(data_path[0])
    except ValueError:
        return list(data_path), None
    if len(data_path) % 2:
        raise ConfigError(f"{flag} {' '.join(data_path)}: weights and prefixes must come in "
                          f"WEIGHT PREFIX pairs")
    weights = []
    for w in data_path[0::2]:
        try:
            weights.append(float(w))
        except ValueError:
            raise ConfigError(f"{flag} weight {w!r} is not a number; use WEIGHT PREFIX pairs") from None
    normalize_weights(weights, flag)
    return list(data_path[1::2]), weights


def read_data_args(path: str) -> list[str]:
    """The words of a --data-args-path file: what --data-path would take, split on any whitespace, so
    that a blend of hundreds of prefixes can be one `WEIGHT PREFIX` line each."""
    words = read_text(path, DataError, "--data-args-path").split()
    if not words:
        raise DataError(f"--data-args-path {path} is empty; write PREFIX or WEIGHT PREFIX pairs in it")
    return words


def parse_split(split: str) -> list[float]:
    """Normalised train/valid/test shares from "969,30,1" (or "98/2/0"; missing shares are 0)."""
    try:
        shares = [float(s) for s in split.replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(f"--split {split!r} must be up to three numbers like 969,30,1") from None
    if len(shares) > 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ConfigError(f"--split {split!r} must be up to three non-negative numbers with a positive sum")
    shares += [0.0] * (3 - len(shares))
    return (np.asarray(shares) / np.sum(shares)).tolist()


def split_ranges(num_documents: int, shares: list[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges for the shares: split i is [round(c_i * n), round(c_(i+1) * n)) for the
    cumulative shares c_0 = 0, c_1 = s_0, c_2 = s_0 + s_1, ... (Megatron-Core's rule; Python's round)."""
    cumulative = [0.0]
    for share in shares:
        cumulative.append(cumulative[-1] + share)
    bounds = [int(round(c * float(num_documents))) for c in cumulative]
    return list(zip(bounds[:-1], bounds[1:]))


def build_train_valid_test_datasets(data_path: list[str], split: str, seq_length: int, seed: int,
                                    num_samples: tuple[int, int, int], cache_dir: str | None = None, *,
                                    vocab_size: int, mmap_bin_files: bool = True, flag: str = "--data-path"):
    """(train, valid, test) from one blend cut by `split`: each yields >= num_samples[i] samples of
    seq_length + 1 tokens, or is None when its --split share is 0 or no samples are asked of it.

    Every token id must be below `vocab_size` (the model's vocabulary, unpadded); each dataset is
    checked on first use and the result cached, so that data made with another tokenizer fails here.
    """
    _check_num_samples(num_samples)
    prefixes, weights = parse_data_path(data_path, flag)
    shares = parse_split(split)
    indexed = _open_checked(prefixes, vocab_size, cache_dir, mmap_bin_files)
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
        results.append(_blend(indexed, [r[i] for r in ranges], weights, num_samples[i], name, seq_length, seed,
                              cache_dir))
    return tuple(results)


def build_per_split_datasets(data_paths: tuple[list[str], list[str], list[str]], seq_length: int, seed: int,
                             num_samples: tuple[int, int, int], cache_dir: str | None = None, *,
                             vocab_size: int, mmap_bin_files: bool = True):
    """(train, valid, test), each from all documents of its own blend (Megatron's --train-data-path,
    --valid-data-path, --test-data-path); a split without a blend, or asked no samples, is None."""
    _check_num_samples(num_samples)
    results = []
    for data_path, n, name in zip(data_paths, num_samples, SPLIT_NAMES):
        if not data_path or n == 0:
            results.append(None)
            continue
        prefixes, weights = parse_data_path(data_path, f"--{name}-data-path")
        indexed = _open_checked(prefixes, vocab_size, cache_dir, mmap_bin_files)
        # Megatron reads a per-split blend of one prefix as that prefix alone, weight or not
        results.append(_blend(indexed, [(0, len(ds)) for ds in indexed], weights if len(indexed) > 1 else None, n,
                              name, seq_length, seed, cache_dir))
    return tuple(results)


def _check_num_samples(num_samples: tuple[int, int, int]) -> None:
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three non-negative counts, got {num_samples}")


def _open_checked(prefixes: list[str], vocab_size: int, cache_dir: str | None, mmap_bin: bool
                  ) -> list[IndexedDataset]:
    """The indexed datasets of `prefixes`, each holding tokens and only ids below `vocab_size`."""
    indexed = [IndexedDataset(prefix, mmap_bin) for prefix in prefixes]
    for ds in indexed:
        if ds.num_tokens == 0:
            raise DataError(f"data prefix {ds.prefix} holds no tokens ({len(ds)} sequences); "
                            f"preprocess a corpus with text in it")
        check_token_ids(ds, vocab_size, cache_dir or default_cache_dir(ds.prefix))
    return indexed


def _blend(indexed: list[IndexedDataset], document_ranges: list[tuple[int, int]], weights: list[float] | None,
           num_samples: int, split_name: str, seq_length: int, seed: int, cache_dir: str | None):
    """One split over documents document_ranges[k] of indexed[k]: a GPTDataset for one prefix without
    weights; else a BlendedDataset, by `weights` or, without them, by each prefix's samples per epoch."""
    def make(k, n):
        return GPTDataset(indexed[k], document_ranges[k], n, seq_length, seed, cache_dir, split_name=split_name)

    cache = cache_dir or default_cache_dir(indexed[0].prefix)
    if weights is None and len(indexed) == 1:
        return make(0, num_samples)
    if weights is not None:
        # Megatron normalises the weights in the builder and again in BlendedDataset
        normalized = normalize_weights(weights).tolist()
        targets = [math.ceil(num_samples * w) for w in normalized]
        components = [make(k, math.ceil(t * (1 + MID_LEVEL_DATASET_SURPLUS))) for k, t in enumerate(targets)]
        blend = _blending_indices(normalized, sum(targets), split_name, cache)
        return BlendedDataset(components, blend["dataset_index"], blend["dataset_sample_index"])
    components = [make(k, 0) for k in range(len(indexed))]  # one epoch each: Megatron's num_samples=None
    blend = _blending_indices([len(c) for c in components], num_samples, split_name, cache)
    counts = np.bincount(blend["dataset_index"], minlength=len(indexed))
    components = [make(k, int(counts[k])) if counts[k] > len(c) else c for k, c in enumerate(components)]
    return BlendedDataset(components, blend["dataset_index"], blend["dataset_sample_index"])


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


def _blending_indices(weights: list[float], size: int, split_name: str, cache_dir: str) -> dict[str, np.ndarray]:
    """Blending indices, cached so that one process builds them and the others map the result."""
    description = {"class": "BlendedDataset", "split": split_name, "weights": normalize_weights(weights).tolist(),
                   "size": size}

    def build():
        dataset_index, dataset_sample_index = build_blending_indices(weights, size)
        return {"dataset_index": dataset_index, "dataset_sample_index": dataset_sample_index}

    return load_or_build(cache_dir, description, build)
