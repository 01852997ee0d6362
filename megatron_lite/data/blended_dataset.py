"""BlendedDataset: interleaves several datasets so each supplies its weight's share of samples.

Sample i comes from dataset_index[i], as that dataset's dataset_sample_index[i]-th sample. The
interleaving is Megatron-Core's (build_blending_indices in megatron/core/datasets/helpers.cpp): sample
i goes to the dataset furthest behind its share, the largest w_d * max(i, 1) - (samples dataset d has
given so far), ties to the lower dataset. After any n samples, dataset d has supplied n * w_d of them
up to rounding. Randomness comes from each component's own shuffle.

The greedy choice depends on every earlier one, so it runs sample by sample: in Python for a few
datasets (about 1 microsecond a sample for three), with a numpy argmax over the datasets for many.
The builder caches the result, so one process pays this once per blend.
"""

import numpy as np

from megatron_lite.errors import ConfigError

_PYTHON_LOOP_MAX_DATASETS = 32  # beyond this the numpy argmax per sample is the faster


def normalize_weights(weights: list[float], flag: str = "--data-path") -> np.ndarray:
    """The weights scaled to sum to 1 (float64, as Megatron's utils.normalize); `flag` names where they
    came from in the error."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) == 0 or not np.all(np.isfinite(weights)) or np.any(weights <= 0):
        raise ConfigError(f"blend weights must be positive numbers, got {weights.tolist()}; "
                          f"fix the weights in {flag}")
    return weights / np.sum(weights)


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) for `size` samples blended by `weights`."""
    weights = normalize_weights(weights)
    if len(weights) > np.iinfo(np.int16).max:
        raise ConfigError(f"cannot blend {len(weights)} datasets; at most {np.iinfo(np.int16).max}")
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    if len(weights) <= _PYTHON_LOOP_MAX_DATASETS:
        _greedy_python(weights.tolist(), dataset_index, dataset_sample_index)
    else:
        _greedy_numpy(weights, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def _greedy_python(weights: list[float], dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> None:
    """The greedy interleaving in double-precision Python floats, as the C++ loop computes it."""
    counts = [0] * len(weights)
    later = range(1, len(weights))
    chosen, taken = [0] * len(dataset_index), [0] * len(dataset_index)
    for i in range(len(dataset_index)):
        scale = float(max(i, 1))
        best, best_error = 0, weights[0] * scale - counts[0]
        for d in later:
            error = weights[d] * scale - counts[d]
            if error > best_error:
                best, best_error = d, error
        chosen[i], taken[i] = best, counts[best]
        counts[best] += 1
    dataset_index[:] = chosen
    dataset_sample_index[:] = taken


def _greedy_numpy(weights: np.ndarray, dataset_index: np.ndarray, dataset_sample_index: np.ndarray) -> None:
    """The same choice with the errors of all datasets as one array (argmax takes the first maximum)."""
    counts = np.zeros(len(weights), dtype=np.float64)  # whole numbers, exact in float64 below 2**53
    errors = np.empty_like(weights)
    chosen, taken = [0] * len(dataset_index), [0] * len(dataset_index)
    for i in range(len(dataset_index)):
        np.multiply(weights, float(max(i, 1)), out=errors)
        np.subtract(errors, counts, out=errors)
        best = int(errors.argmax())
        chosen[i], taken[i] = best, int(counts[best])
        counts[best] += 1
    dataset_index[:] = chosen
    dataset_sample_index[:] = taken


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
