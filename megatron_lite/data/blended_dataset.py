"""BlendedDataset: interleaves several datasets so each supplies its weight's share of samples.

Sample i comes from dataset_index[i], as that dataset's dataset_sample_index[i]-th sample.
The interleaving is deterministic and stays close to the weights in every prefix of the
stream, not just on average: dataset d's k-th sample is due at time (k + 1/2) / w_d and the
samples are taken in order of due time (stride scheduling). After any n samples, dataset d
has supplied n * w_d of them up to rounding. Megatron reaches the same property with a
greedy loop in C++; sorting due times gets it in vectorised numpy. Randomness comes from
each component's own shuffle.
"""

import math

import numpy as np

from megatron_lite.validation import ConfigError


def normalize_weights(weights: list[float], flag: str = "--data-path") -> np.ndarray:
    """The weights scaled to sum to 1; `flag` names where they came from in the error."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) == 0 or not np.all(np.isfinite(weights)) or np.any(weights <= 0):
        raise ConfigError(f"blend weights must be positive numbers, got {weights.tolist()}; "
                          f"fix the weights in {flag}")
    return weights / weights.sum()


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for `size` samples blended by `weights`."""
    weights = normalize_weights(weights)
    if len(weights) > np.iinfo(np.int16).max:
        raise ConfigError(f"cannot blend {len(weights)} datasets; at most {np.iinfo(np.int16).max}")
    due_times, owners, ranks = [], [], []
    for d, w in enumerate(weights):
        candidates = math.floor(w * size) + 2  # more than dataset d can supply in `size` samples
        k = np.arange(candidates, dtype=np.int64)
        due_times.append((k + 0.5) / w)
        owners.append(np.full(candidates, d, dtype=np.int16))
        ranks.append(k)
    due_times, owners, ranks = map(np.concatenate, (due_times, owners, ranks))
    order = np.lexsort((owners, due_times))[:size]  # by due time, ties to the lower dataset
    return owners[order], ranks[order]


class BlendedDataset:
    """Sample i is datasets[dataset_index[i]][dataset_sample_index[i]]."""

    def __init__(self, datasets: list, dataset_index: np.ndarray, dataset_sample_index: np.ndarray):
        for d, dataset in enumerate(datasets):
            needed = dataset_sample_index[dataset_index == d]
            if needed.size and needed.max() >= len(dataset):
                raise ValueError(f"blended component {d} has {len(dataset)} samples, the blend needs "
                                 f"{needed.max() + 1}")
        self.datasets = datasets
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
