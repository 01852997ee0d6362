"""Where the corpus comes from: --train/--valid/--test-data-path, --data-args-path, --no-mmap-bin-files."""

import numpy as np
import pytest

from megatron_lite.config.arguments import parse_config
from megatron_lite.data.builder import build_per_split_datasets
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.errors import ConfigError, DataError
from megatron_lite.training.loop import build_datasets
from tests import corpora

SEQ = 32
VOCAB = 3000


def make_prefix(tmp_path, name, first_token, documents=120):
    return corpora.make_prefix(tmp_path, name, first_token, documents, np.uint16)


def datasets_for(*flags: str):
    """build_datasets of a pretrain_gpt.py command line: 10 iterations of 8 samples, one evaluation of 2 batches."""
    argv = ["--model-preset", "llama-tiny", "--vocab-size", str(VOCAB), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", "8", "--global-batch-size", "8",
            "--train-iters", "10", "--eval-interval", "10", "--eval-iters", "2", *flags]
    return build_datasets(parse_config(argv, world_size=1))


def samples(dataset) -> np.ndarray:
    return np.stack([dataset[i] for i in range(len(dataset))])


def test_each_split_reads_only_its_own_corpus(tmp_path):
    train_prefix, valid_prefix = make_prefix(tmp_path, "train", 0), make_prefix(tmp_path, "valid", 2000)
    train, valid, test = datasets_for("--train-data-path", train_prefix, "--valid-data-path", valid_prefix)
    assert test is None  # training reads no test samples
    assert len(train) >= 80 and len(valid) >= 16
    assert samples(train).max() < 1000 and samples(valid).min() >= 2000
    # a corpus per split is read whole, not cut by --split
    assert set(train.document_index.tolist()) == set(range(120))
    assert set(valid.document_index.tolist()) == set(range(120))


def test_a_split_without_a_corpus_is_none(tmp_path):
    train, valid, test = build_per_split_datasets(([make_prefix(tmp_path, "a", 0)], [], []), SEQ, 1, (50, 10, 0),
                                                  vocab_size=VOCAB)
    assert len(train) >= 50 and valid is None and test is None


def test_a_per_split_blend_mixes_its_own_prefixes(tmp_path):
    a, b, c = (make_prefix(tmp_path, name, first) for name, first in (("a", 0), ("b", 1000), ("c", 2000)))
    train, valid, _ = datasets_for("--train-data-path", "0.5", a, "0.5", b, "--valid-data-path", c)
    tokens = samples(train)
    assert tokens.min() < 1000 <= tokens.max() < 2000
    assert samples(valid).min() >= 2000


def test_data_args_path_equals_the_same_blend_given_inline(tmp_path):
    a, b = make_prefix(tmp_path, "a", 0), make_prefix(tmp_path, "b", 1000)
    args_file = tmp_path / "blend.txt"
    args_file.write_text(f"0.3 {a}\n0.7 {b}\n")
    inline = datasets_for("--data-path", "0.3", a, "0.7", b, "--split", "90,10,0")
    from_file = datasets_for("--data-args-path", str(args_file), "--split", "90,10,0")
    for inline_split, file_split in zip(inline[:2], from_file[:2]):
        np.testing.assert_array_equal(samples(inline_split), samples(file_split))


def test_no_mmap_bin_files_gives_the_same_samples(tmp_path):
    prefix = make_prefix(tmp_path, "a", 0)
    mapped = datasets_for("--data-path", prefix, "--split", "90,10,0")
    read = datasets_for("--data-path", prefix, "--split", "90,10,0", "--no-mmap-bin-files")
    assert read[0].indexed_dataset.mmap_bin is False
    for mapped_split, read_split in zip(mapped[:2], read[:2]):
        np.testing.assert_array_equal(samples(mapped_split), samples(read_split))


def test_file_reads_match_the_map_for_every_sequence_and_the_token_range(tmp_path):
    prefix = make_prefix(tmp_path, "a", 7)
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap_bin=False)
    for i in range(len(mapped)):
        np.testing.assert_array_equal(mapped.get(i, 3, 10), read.get(i, 3, 10))
        np.testing.assert_array_equal(mapped[i], read[i])
    assert read.token_id_range() == mapped.token_id_range() == (7, 7 + int(mapped.sequence_lengths.max()) - 1)


@pytest.mark.parametrize("flags, message", [
    (["--data-path", "a", "--train-data-path", "b"], "--data-path .* and --train-data-path .* exclude each other"),
    (["--data-path", "a", "--data-args-path", "f"], "give --data-path or --data-args-path .* not both"),
    (["--valid-data-path", "b"], "--valid-data-path acts only with --train-data-path"),
    ([], "no training data: pass --data-path PREFIX"),
])
def test_conflicting_data_sources_are_one_line_errors(flags, message):
    with pytest.raises(ConfigError, match=message) as error:
        datasets_for(*flags)
    assert "\n" not in str(error.value)


def test_bad_data_args_files_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="--data-args-path .*missing.txt: cannot read it") as error:
        datasets_for("--data-args-path", str(tmp_path / "missing.txt"))
    assert "\n" not in str(error.value)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(DataError, match="empty.txt is empty"):
        datasets_for("--data-args-path", str(tmp_path / "empty.txt"))
    (tmp_path / "odd.txt").write_text(f"0.3 {tmp_path / 'a'}\n0.7\n")
    with pytest.raises(ConfigError, match="--data-args-path .*odd.txt .*WEIGHT PREFIX pairs"):
        datasets_for("--data-args-path", str(tmp_path / "odd.txt"))


def test_a_bad_per_split_weight_names_its_flag(tmp_path):
    prefix = make_prefix(tmp_path, "a", 0)
    with pytest.raises(ConfigError, match="--valid-data-path weight 'x' is not a number"):
        datasets_for("--train-data-path", prefix, "--valid-data-path", "1", prefix, "x", prefix)
