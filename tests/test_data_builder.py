"""--data-path / --split into train, valid and test datasets, single or blended."""

import math

import numpy as np
import pytest

from megatron_lite.data.builder import build_train_valid_test_datasets, parse_data_path, parse_split, split_ranges
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_lite.errors import DataError
from tests import corpora

SEQ = 32
VOCAB = 3000  # make_prefix ids lie below 3000


def make_prefix(tmp_path, name, first_token, documents=200):
    return corpora.make_prefix(tmp_path, name, first_token, documents, np.int32)


def test_data_path_forms():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])


@pytest.mark.parametrize("data_path, message", [
    ([], "--data-path is empty"), (["0.3", "a", "0.7"], "WEIGHT PREFIX pairs"),
    (["0.3", "a", "b", "c"], "'b' is not a number"), (["-1", "a", "2", "b"], "positive")])
def test_bad_data_paths_say_what_to_change(data_path, message):
    with pytest.raises(ValueError, match=message):
        parse_data_path(data_path)


def test_split_parsing_and_megatron_rounding():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_ranges(1000, parse_split("969,30,1")) == [(0, 969), (969, 999), (999, 1000)]
    # Megatron-Core rounds the cumulative bounds: 10 x 1/3 = 3.33 -> 3, 10 x 2/3 = 6.67 -> 7
    assert split_ranges(10, parse_split("1,1,1")) == [(0, 3), (3, 7), (7, 10)]
    # 294 x 0.9 = 264.6 -> 265 and 294 x 0.97 = 285.18 -> 285 (legacy Megatron-LM, rounding each share, gave 264)
    assert split_ranges(294, parse_split("90,7,3")) == [(0, 265), (265, 285), (285, 294)]
    with pytest.raises(ValueError, match="--split"):
        parse_split("90,x")


def test_each_split_yields_at_least_its_samples_from_its_own_documents(tmp_path):
    prefix = make_prefix(tmp_path, "a", 0)
    train, valid, test = build_train_valid_test_datasets([prefix], "90,10,0", SEQ, 1, (500, 40, 7), vocab_size=VOCAB)
    assert test is None
    assert len(train) >= 500 and len(valid) >= 40
    assert train[0].shape == (SEQ + 1,) and train[0].dtype == np.int64
    assert (tmp_path / "cache").is_dir()  # the default cache sits beside the data
    assert set(train.document_index.tolist()) == set(range(180))
    assert set(valid.document_index.tolist()) == set(range(180, 200))


def test_blend_shares_are_within_one_percent_of_the_weights(tmp_path):
    prefixes = [make_prefix(tmp_path, name, first) for name, first in (("a", 0), ("b", 1000), ("c", 2000))]
    weights = [0.2, 0.3, 0.5]
    data_path = [str(x) for pair in zip(weights, prefixes) for x in pair]
    train, _, _ = build_train_valid_test_datasets(data_path, "1", SEQ, 1, (10_000, 0, 0), str(tmp_path / "c"),
                                                  vocab_size=VOCAB)
    assert len(train) == sum(math.ceil(10_000 * w) for w in weights)  # Megatron's blend size: sum of ceil(n w)
    source = np.array([train[i][0] // 1000 for i in range(len(train))])  # which corpus each sample came from
    shares = np.bincount(source, minlength=3) / len(train)
    assert np.all(np.abs(shares - weights) < 0.01), shares


def test_unweighted_prefixes_blend_by_samples_per_epoch(tmp_path):
    small, large = make_prefix(tmp_path, "s", 0, documents=50), make_prefix(tmp_path, "l", 1000, documents=150)
    train, _, _ = build_train_valid_test_datasets([small, large], "1", SEQ, 1, (2000, 0, 0), vocab_size=VOCAB)
    # Megatron weighs each prefix by the length of its one-epoch GPTDataset, (tokens - 1) // seq_length
    per_epoch = [(d.indexed_dataset.num_tokens - 1) // SEQ for d in train.datasets]
    expected = per_epoch[0] / sum(per_epoch)
    from_small = np.mean([train[i][0] < 1000 for i in range(len(train))])
    assert abs(from_small - expected) < 0.01


def test_a_split_without_documents_says_what_to_change(tmp_path):
    prefix = make_prefix(tmp_path, "a", 0, documents=200)
    with pytest.raises(DataError, match="test split .* gets no documents of its 200, but 10 test samples are needed"):
        build_train_valid_test_datasets([prefix], "969,30,1", SEQ, 1, (10, 10, 10), vocab_size=VOCAB)


def test_missing_prefix_is_named(tmp_path):
    with pytest.raises(DataError, match="missing.idx not found"):
        build_train_valid_test_datasets([str(tmp_path / "missing")], "1", SEQ, 1, (10, 0, 0), vocab_size=VOCAB)


def test_token_ids_beyond_the_vocabulary_are_refused_from_a_cached_scan(tmp_path, monkeypatch):
    prefix = make_prefix(tmp_path, "a", 0)
    largest = int(max(IndexedDataset(prefix)[i].max() for i in range(200)))
    with pytest.raises(DataError, match=rf"a.bin holds token id {largest}, but the model's vocabulary has "
                                        rf"{largest} ids \(0..{largest - 1}\)"):
        build_train_valid_test_datasets([prefix], "1", SEQ, 1, (10, 0, 0), vocab_size=largest)
    assert list((tmp_path / "cache").glob("*-TokenIdRange-token_id_range.npy"))
    monkeypatch.setattr(IndexedDataset, "token_id_range", lambda self: pytest.fail(".bin scanned again"))
    with pytest.raises(DataError, match=f"holds token id {largest}"):
        build_train_valid_test_datasets([prefix], "1", SEQ, 1, (10, 0, 0), vocab_size=largest)
    train, _, _ = build_train_valid_test_datasets([prefix], "1", SEQ, 1, (10, 0, 0), vocab_size=largest + 1)
    assert len(train) >= 10


def test_a_rewritten_bin_is_scanned_again(tmp_path):
    prefix = make_prefix(tmp_path, "a", 0)
    build_train_valid_test_datasets([prefix], "1", SEQ, 1, (10, 0, 0), vocab_size=1000)
    make_prefix(tmp_path, "a", 5000)  # the same name, now with ids from 5000
    with pytest.raises(DataError, match=r"holds token id 50\d\d, but the model's vocabulary has 1000 ids"):
        build_train_valid_test_datasets([prefix], "1", SEQ, 1, (10, 0, 0), vocab_size=1000)


def test_an_idx_that_reads_the_tokens_as_signed_is_refused(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "a"), np.uint16)
    builder.add_document(np.arange(40000, 40100))
    builder.finalize()
    idx = bytearray((tmp_path / "a.idx").read_bytes())
    idx[17] = 3  # int16: the same size as uint16, so only the values give it away
    (tmp_path / "a.idx").write_bytes(bytes(idx))
    with pytest.raises(DataError, match=r"a.bin holds a negative token id \(-25536\): it was not written as the "
                                        r"int16 tokens its .idx declares"):
        build_train_valid_test_datasets([str(tmp_path / "a")], "1", SEQ, 1, (1, 0, 0), vocab_size=50000)


def test_an_empty_dataset_is_refused(tmp_path):
    IndexedDatasetBuilder(str(tmp_path / "empty"), np.uint16).finalize()
    with pytest.raises(DataError, match=r"empty holds no tokens \(0 sequences\)"):
        build_train_valid_test_datasets([str(tmp_path / "empty")], "1", SEQ, 1, (10, 0, 0), vocab_size=VOCAB)


def test_a_split_without_documents_is_fine_when_none_of_its_samples_are_needed(tmp_path):
    prefix = make_prefix(tmp_path, "a", 0, documents=200)  # the test share, 1 of 1000, rounds to no document
    train, valid, test = build_train_valid_test_datasets([prefix], "969,30,1", SEQ, 1, (10, 10, 0), vocab_size=VOCAB)
    assert test is None and len(valid) >= 10
