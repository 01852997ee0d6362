"""The .bin/.idx files are Megatron-LM's MMapIndexedDataset format, byte for byte."""

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.data import indexed_dataset
from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, smallest_dtype
from megatron_lite.errors import DataError

REPO = Path(__file__).resolve().parents[1]


def write_dataset(prefix, documents, dtype=np.uint16):
    builder = IndexedDatasetBuilder(str(prefix), dtype)
    for document in documents:
        builder.add_document(document)
    builder.finalize()
    return IndexedDataset(str(prefix))


def hand_made_index(dtype_code, sequence_lengths, sequence_pointers, document_indices, magic=b"MMIDIDX\x00\x00",
                    version=1):
    """An .idx built from the published layout, independently of our writer."""
    return (magic + struct.pack("<Q", version) + struct.pack("<B", dtype_code)
            + struct.pack("<Q", len(sequence_lengths)) + struct.pack("<Q", len(document_indices))
            + struct.pack(f"<{len(sequence_lengths)}i", *sequence_lengths)
            + struct.pack(f"<{len(sequence_pointers)}q", *sequence_pointers)
            + struct.pack(f"<{len(document_indices)}q", *document_indices))


def test_writer_produces_the_published_idx_and_bin_bytes(tmp_path):
    write_dataset(tmp_path / "ds", [[1, 2, 3], [40000, 5], [6]], np.uint16)
    # uint16 is dtype code 8; pointers are byte offsets (2 bytes per token); one sequence per document.
    expected_idx = hand_made_index(8, [3, 2, 1], [0, 6, 10], [0, 1, 2, 3])
    assert (tmp_path / "ds.idx").read_bytes() == expected_idx
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 40000, 5, 6)


def test_reads_a_hand_made_pair_with_multi_sequence_documents(tmp_path):
    # Two documents in int32 (code 4): the first holds two sequences, as Megatron's sentence-split data does.
    tokens = [7, 8, 9, 100000, 11, 12]
    (tmp_path / "ds.bin").write_bytes(struct.pack("<6i", *tokens))
    (tmp_path / "ds.idx").write_bytes(hand_made_index(4, [2, 1, 3], [0, 8, 12], [0, 2, 3]))
    ds = IndexedDataset(str(tmp_path / "ds"))
    assert ds.dtype == np.int32 and len(ds) == 3
    assert [ds[i].tolist() for i in range(3)] == [[7, 8], [9], [100000, 11, 12]]
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert ds.get(2, offset=1, length=2).tolist() == [11, 12]
    assert ds.num_tokens == 6


def test_reads_are_zero_copy_views_of_the_bin(tmp_path):
    ds = write_dataset(tmp_path / "ds", [[1, 2, 3], [4, 5]])
    view = ds[1]
    assert not view.flags.owndata and not view.flags.writeable


@pytest.mark.parametrize("vocab_size, dtype", [(256, np.uint8), (257, np.uint16), (65536, np.uint16),
                                               (65537, np.int32)])
def test_smallest_dtype_holds_every_id(vocab_size, dtype):
    assert smallest_dtype(vocab_size) == dtype


@pytest.mark.parametrize("corrupt, message", [
    (lambda idx, bin_: (b"NOTANIDX\x00" + idx[9:], bin_), "magic"),
    (lambda idx, bin_: (idx[:9] + struct.pack("<Q", 2) + idx[17:], bin_), "version 2"),
    (lambda idx, bin_: (idx, bin_[:-1]), "ds.bin has 9 bytes but .* describes 5 uint16 tokens"),
    (lambda idx, bin_: (idx[:30], bin_), "truncated"),
])
def test_damaged_files_raise_one_line_errors(tmp_path, corrupt, message):
    write_dataset(tmp_path / "ds", [[1, 2, 3], [4, 5]])
    idx, bin_ = corrupt((tmp_path / "ds.idx").read_bytes(), (tmp_path / "ds.bin").read_bytes())
    (tmp_path / "ds.idx").write_bytes(idx)
    (tmp_path / "ds.bin").write_bytes(bin_)
    with pytest.raises(ValueError, match=message) as error:
        IndexedDataset(str(tmp_path / "ds"))
    assert "\n" not in str(error.value)


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(DataError, match="nothing.idx not found"):
        IndexedDataset(str(tmp_path / "nothing"))


def test_an_unfinished_build_leaves_no_readable_pair(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ds"), np.uint16)
    builder.add_document([1, 2, 3])
    assert not (tmp_path / "ds.bin").exists() and not (tmp_path / "ds.idx").exists()
    builder.abort()
    assert list(tmp_path.iterdir()) == []


def test_tokens_beyond_the_dtype_are_refused(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "ds"), np.uint8)
    with pytest.raises(ValueError, match="does not fit dtype uint8"):
        builder.add_document([1, 300])
    builder.abort()


def test_merge_tool_concatenates_documents_in_order(tmp_path):
    write_dataset(tmp_path / "a", [[1, 2], [3]])
    (tmp_path / "b.bin").write_bytes(struct.pack("<3H", 4, 5, 6))
    (tmp_path / "b.idx").write_bytes(hand_made_index(8, [1, 2], [0, 2], [0, 2]))  # one 2-sequence document
    result = subprocess.run([sys.executable, "tools/merge_datasets.py", "--input", str(tmp_path / "a"),
                             str(tmp_path / "b"), "--output-prefix", str(tmp_path / "ab")],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    merged = IndexedDataset(str(tmp_path / "ab"))
    assert [merged[i].tolist() for i in range(len(merged))] == [[1, 2], [3], [4], [5, 6]]
    assert merged.document_indices.tolist() == [0, 1, 2, 4]
    assert (tmp_path / "ab.idx").read_bytes() == hand_made_index(8, [2, 1, 1, 2], [0, 4, 6, 8], [0, 1, 2, 4])


def test_a_bin_written_in_another_dtype_than_its_idx_is_refused(tmp_path):
    # int32 tokens behind an .idx that says uint16: read as uint16 they would be 12 tokens, half of them zeros.
    (tmp_path / "ds.bin").write_bytes(struct.pack("<6i", 1, 2, 3, 4, 5, 6))
    (tmp_path / "ds.idx").write_bytes(hand_made_index(8, [3, 2, 1], [0, 6, 10], [0, 1, 2, 3]))
    with pytest.raises(DataError, match=r"ds.bin has 24 bytes but .*ds.idx describes 6 uint16 tokens \(12 bytes\) "
                                        r"\(the size fits int32 tokens\)"):
        IndexedDataset(str(tmp_path / "ds"))


@pytest.mark.parametrize("code, message", [
    (4, r"describes 5 int32 tokens \(20 bytes\)"),  # same file, another dtype byte
    (99, "dtype code 99, not a token dtype"),
    (7, "dtype code 7, not a token dtype"),  # float32: a Megatron dtype, but not one tokens can have
])
def test_an_idx_whose_dtype_byte_was_changed_is_refused(tmp_path, code, message):
    write_dataset(tmp_path / "ds", [[1, 2, 3], [4, 5]], np.uint16)
    idx = bytearray((tmp_path / "ds.idx").read_bytes())
    idx[17] = code  # after the 9-byte magic and the 8-byte version
    (tmp_path / "ds.idx").write_bytes(bytes(idx))
    with pytest.raises(DataError, match=message):
        IndexedDataset(str(tmp_path / "ds"))


@pytest.mark.parametrize("lengths, pointers, documents, message", [
    ([3, 2, 1], [0, 10, 6], [0, 1, 2, 3], "sequence 1 starts at byte 10 of the .bin, but the sequence lengths "
                                          "place it at byte 6"),  # not monotone
    ([3, 2, 1], [0, 6, 4096], [0, 1, 2, 3], "sequence 2 starts at byte 4096"),  # beyond the .bin
    ([3, -1, 4], [0, 6, 4], [0, 1, 2, 3], "sequence 1 has a negative length"),
    ([3, 2, 1], [0, 6, 10], [0, 2, 1, 3], "document indices are not an increasing run from 0"),
    ([3, 2, 1], [0, 6, 10], [0, 1, 2], "document indices are not an increasing run from 0 to the sequence count 3"),
])
def test_an_idx_inconsistent_with_itself_is_refused(tmp_path, lengths, pointers, documents, message):
    (tmp_path / "ds.bin").write_bytes(struct.pack("<6H", *range(6)))
    (tmp_path / "ds.idx").write_bytes(hand_made_index(8, lengths, pointers, documents))
    with pytest.raises(DataError, match=message) as error:
        IndexedDataset(str(tmp_path / "ds"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("corrupt, message", [
    (lambda idx: b"", r"ds.idx is truncated \(0 bytes, shorter than its header\)"),
    (lambda idx: idx + b"\x00" * 8, "ds.idx has trailing bytes"),
])
def test_an_idx_of_the_wrong_length_is_refused(tmp_path, corrupt, message):
    write_dataset(tmp_path / "ds", [[1, 2, 3], [4, 5]])
    (tmp_path / "ds.idx").write_bytes(corrupt((tmp_path / "ds.idx").read_bytes()))
    with pytest.raises(DataError, match=message):
        IndexedDataset(str(tmp_path / "ds"))


@pytest.mark.parametrize("given, hint", [
    ("ds.bin", "give the prefix without the suffix: {tmp}/ds$"),
    ("ds.idx", "give the prefix without the suffix: {tmp}/ds$"),
    ("corpus.jsonl", "corpus.jsonl is raw text: tokenize it with tools/preprocess_data.py --input {tmp}/corpus.jsonl"),
    ("out", r"did you mean {tmp}/out_text_document \(what tools/preprocess_data.py writes\)\?"),
    ("elsewhere", "give the PREFIX of a PREFIX.bin/PREFIX.idx pair made by tools/preprocess_data.py"),
])
def test_a_missing_prefix_suggests_what_was_meant(tmp_path, given, hint):
    write_dataset(tmp_path / "ds", [[1, 2]])
    write_dataset(tmp_path / "out_text_document", [[1, 2]])
    (tmp_path / "corpus.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(DataError, match=hint.format(tmp=tmp_path)):
        IndexedDataset(str(tmp_path / given))


def test_token_id_range_spans_every_chunk_of_the_scan(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed_dataset, "_SCAN_CHUNK_TOKENS", 4)
    ds = write_dataset(tmp_path / "ds", [[7, 8, 9], [6, 5000, 12], [3, 11]])
    assert ds.token_id_range() == (3, 5000)


def test_pointers_are_checked_across_chunks_of_the_index(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed_dataset, "_CHECK_CHUNK_SEQUENCES", 2)
    (tmp_path / "ds.bin").write_bytes(struct.pack("<6H", *range(6)))
    (tmp_path / "ds.idx").write_bytes(hand_made_index(8, [1, 1, 1, 2, 1], [0, 2, 4, 6, 10], [0, 1, 2, 3, 4, 5]))
    assert [sequence.tolist() for sequence in IndexedDataset(str(tmp_path / "ds"))] == [[0], [1], [2], [3, 4], [5]]
    (tmp_path / "ds.idx").write_bytes(hand_made_index(8, [1, 1, 1, 2, 1], [0, 2, 4, 6, 8], [0, 1, 2, 3, 4, 5]))
    with pytest.raises(DataError, match="sequence 4 starts at byte 8 of the .bin, but the sequence lengths place "
                                        "it at byte 10"):
        IndexedDataset(str(tmp_path / "ds"))
