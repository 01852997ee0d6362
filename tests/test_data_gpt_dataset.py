"""GPTDataset: fixed-length samples that cover the split's tokens, with an index built once and cached."""

import multiprocessing
import os
import pickle
import time

import numpy as np
import pytest

from megatron_lite.data import gpt_dataset, index_cache
from megatron_lite.data.gpt_dataset import GPTDataset
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

SEQ = 16


@pytest.fixture
def corpus(tmp_path):
    """40 documents of 1..60 tokens whose ids are their positions in the .bin, so every token is unique."""
    lengths = np.random.default_rng(0).integers(1, 60, size=40)
    builder = IndexedDatasetBuilder(str(tmp_path / "ds"), np.int32)
    start = 0
    for n in lengths:
        builder.add_document(np.arange(start, start + n))
        start += n
    builder.finalize()
    return IndexedDataset(str(tmp_path / "ds"))


def dataset(corpus, num_samples, document_range=(0, 40), seed=1, **kwargs):
    return GPTDataset(corpus, document_range, num_samples, SEQ, seed, **kwargs)


def test_samples_are_seq_length_plus_one_int64_tokens(corpus):
    ds = dataset(corpus, 50)
    assert len(ds) >= 50
    for i in range(len(ds)):
        assert ds[i].dtype == np.int64 and ds[i].shape == (SEQ + 1,)


def test_one_epoch_covers_every_token_of_the_split_but_the_remainder_once(corpus):
    begin, end = 5, 35
    split_tokens = np.concatenate([corpus[d] for d in range(begin, end)])
    per_epoch = (len(split_tokens) - 1) // SEQ
    ds = dataset(corpus, per_epoch, (begin, end))
    assert len(ds) == per_epoch
    inputs = np.concatenate([ds[i][:-1] for i in range(len(ds))])
    assert len(np.unique(inputs)) == len(inputs) == per_epoch * SEQ  # no token twice
    remainder = set(split_tokens.tolist()) - set(inputs.tolist())
    assert len(remainder) == len(split_tokens) - per_epoch * SEQ < SEQ + 1
    # each sample's last token (its final label) is the next token of the same shuffled document stream
    stream = np.concatenate([corpus[int(d)] for d in ds.document_index])
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert ds[i].tolist() == stream[j * SEQ: (j + 1) * SEQ + 1].tolist()


def test_more_samples_than_an_epoch_repeat_each_document_once_per_epoch(corpus):
    per_epoch = (corpus.num_tokens - 1) // SEQ
    ds = dataset(corpus, int(1.9 * per_epoch))  # 0.9 of the second epoch: above 0.8, no separate final epoch
    assert len(ds) >= 1.9 * per_epoch
    assert np.bincount(ds.document_index, minlength=40).tolist() == [2] * 40
    # Megatron-Core shuffles the copies of all epochs together, so an epoch's worth of positions is no permutation
    assert sorted(ds.document_index[:40].tolist()) != list(range(40))


def test_a_separate_final_epoch_keeps_its_document_copies_apart(corpus):
    per_epoch = (corpus.num_tokens - 1) // SEQ
    ds = dataset(corpus, int(2.5 * per_epoch))  # 0.5 of the third epoch: below 0.8, kept apart
    first_two, last = ds.document_index[:80], ds.document_index[80:]
    assert np.bincount(first_two, minlength=40).tolist() == [2] * 40
    assert sorted(last.tolist()) == list(range(40))
    assert sorted(first_two[:40].tolist()) != list(range(40))  # the first two epochs' copies mix


def test_a_small_final_epoch_is_shuffled_separately_and_comes_last(corpus):
    per_epoch = (corpus.num_tokens - 1) // SEQ
    ds = dataset(corpus, per_epoch + 3)  # the second epoch is needed only in small part
    assert set(ds.shuffle_index[:per_epoch].tolist()) == set(range(per_epoch))


def test_the_order_is_a_function_of_the_seed(corpus, tmp_path):
    a, b = dataset(corpus, 30, seed=7), dataset(corpus, 30, seed=7, cache_dir=str(tmp_path / "other"))
    c = dataset(corpus, 30, seed=8)
    assert all(np.array_equal(a[i], b[i]) for i in range(len(a)))
    assert not all(np.array_equal(a[i], c[i]) for i in range(len(a)))


def test_the_index_is_cached_beside_the_data_and_reused(corpus, tmp_path, monkeypatch):
    first = dataset(corpus, 30)
    files = sorted(os.listdir(tmp_path / "cache"))
    assert any(f.endswith("-GPTDataset-train-shuffle_index.npy") for f in files)  # Megatron's file names
    monkeypatch.setattr(gpt_dataset, "build_indices", lambda *a: pytest.fail("index rebuilt"))
    second = dataset(corpus, 30)
    assert np.array_equal(first.shuffle_index, second.shuffle_index)
    assert sorted(os.listdir(tmp_path / "cache")) == files


def test_a_cache_from_another_index_format_is_not_read(corpus, tmp_path, monkeypatch):
    real = gpt_dataset.build_indices

    def earlier_algorithm(*args):  # what older code built for the same description
        indices = real(*args)
        return {**indices, "shuffle_index": indices["shuffle_index"][::-1].copy()}

    monkeypatch.setattr(index_cache, "INDEX_FORMAT", index_cache.INDEX_FORMAT - 1)
    monkeypatch.setattr(gpt_dataset, "build_indices", earlier_algorithm)
    earlier = dataset(corpus, 30).shuffle_index
    monkeypatch.undo()
    current = dataset(corpus, 30).shuffle_index  # the same cache folder and description
    assert not np.array_equal(current, earlier)
    np.testing.assert_array_equal(current, dataset(corpus, 30, cache_dir=str(tmp_path / "fresh")).shuffle_index)


def test_pickling_sends_file_names_not_tokens(corpus):
    ds = dataset(corpus, 500)  # what a spawned DataLoader worker receives
    payload = pickle.dumps(ds)
    assert len(payload) < 2000
    copy = pickle.loads(payload)
    assert all(np.array_equal(copy[i], ds[i]) for i in range(len(ds)))


def _build_in_process(prefix, log, results):
    real = gpt_dataset.build_indices

    def logged(*args):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # long enough that the other processes arrive while this one builds
        return real(*args)

    gpt_dataset.build_indices = logged
    ds = GPTDataset(IndexedDataset(prefix), (0, 40), 100, SEQ, 3)
    results.put([ds[i].tolist() for i in range(len(ds))])


def test_concurrent_processes_build_the_index_once_and_agree(corpus, tmp_path):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    log = tmp_path / "builds.log"
    workers = [context.Process(target=_build_in_process, args=(corpus.prefix, log, results)) for _ in range(3)]
    for w in workers:
        w.start()
    samples = [results.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    assert len(log.read_text().split()) == 1
    assert samples[0] == samples[1] == samples[2]


def test_a_split_shorter_than_one_sample_says_what_to_change(corpus):
    with pytest.raises(ValueError, match="fewer than seq-length"):
        GPTDataset(corpus, (0, 1), 10, 1000, 1)
