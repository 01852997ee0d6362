"""The .bin/.idx files are Megatron-LM's MMapIndexedDataset format, byte for byte."""

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, smallest_dtype

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
    (lambda idx, bin_: (idx, bin_[:-1]), "truncated"),
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
    with pytest.raises(FileNotFoundError, match="nothing.idx not found"):
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
