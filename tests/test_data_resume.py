"""Resuming at consumed_samples = k reads exactly what an uninterrupted run reads from k on."""

import numpy as np
import pytest

from megatron_lite.data.builder import build_train_valid_test_datasets
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder
from megatron_lite.data.samplers import PretrainingSampler

SEQ, MICRO_BATCH, GLOBAL_BATCH, NUM_SAMPLES = 16, 2, 16, 320


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume")
    path = []
    for weight, name in ((0.4, "a"), (0.6, "b")):
        builder = IndexedDatasetBuilder(str(folder / name), np.uint16)
        rng = np.random.default_rng(len(path))
        for _ in range(60):
            builder.add_document(rng.integers(0, 50000, size=rng.integers(5, 90)))
        builder.finalize()
        path += [str(weight), str(folder / name)]
    return path


def fresh_train_dataset(data_path):
    """The train dataset as a restarted job builds it (reading the index cache the first run wrote)."""
    return build_train_valid_test_datasets(data_path, "1", SEQ, 1234, (NUM_SAMPLES, 0, 0), vocab_size=50000)[0]


def read(dataset, consumed: int, dp: int) -> list[list[np.ndarray]]:
    """Per data-parallel rank, the micro-batches it reads from `consumed` on."""
    return [[np.stack([dataset[i] for i in indices])
             for indices in PretrainingSampler(len(dataset), consumed, MICRO_BATCH, rank, dp)]
            for rank in range(dp)]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_matches_the_uninterrupted_run(data_path, dp):
    uninterrupted = read(fresh_train_dataset(data_path), 0, dp)
    for k in (GLOBAL_BATCH, 7 * GLOBAL_BATCH):
        resumed = read(fresh_train_dataset(data_path), k, dp)
        skipped = k // (MICRO_BATCH * dp)  # micro-batch steps each rank already took
        for rank in range(dp):
            assert len(resumed[rank]) == len(uninterrupted[rank]) - skipped
            for got, want in zip(resumed[rank], uninterrupted[rank][skipped:]):
                np.testing.assert_array_equal(got, want)


def test_the_samples_after_k_do_not_depend_on_the_data_parallel_size(data_path):
    k = 3 * GLOBAL_BATCH
    dataset = fresh_train_dataset(data_path)
    single = np.concatenate(read(dataset, k, 1)[0])
    for dp in (2, 4):
        ranks = read(dataset, k, dp)
        interleaved = np.concatenate([batch for step in zip(*ranks) for batch in step])
        np.testing.assert_array_equal(interleaved, single[: len(interleaved)])
