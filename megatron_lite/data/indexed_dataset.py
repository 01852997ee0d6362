"""Megatron's memory-mapped indexed dataset: the `.bin`/`.idx` pair that holds a tokenized corpus.

The format is Megatron-LM's MMapIndexedDataset, byte for byte, so files made here load in
Megatron-LM and the reverse. `PREFIX.bin` is the raw token array. `PREFIX.idx` is:

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the .bin tokens (see DTYPE_CODES)
    uint64    sequence count S
    uint64    document count D (= number of documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence pointers, byte offsets into the .bin
    int64[D]  document indices: document k holds sequences [doc[k], doc[k+1])

all little-endian. Pretraining data has one sequence per document, so doc = [0, 1, ..., S]; SFT data has a
document per row of conversations, a sequence per conversation.
Reading maps the .idx. The .bin is memory-mapped too by default, and sequences are numpy views
of it; with `mmap_bin=False` (Megatron's --no-mmap-bin-files) each sequence is read from the file
instead, for file systems where mapping is slow or not allowed.
"""

import os
import struct

import numpy as np

from megatron_lite.errors import DataError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1

# Megatron's DType enum: the code stored in the .idx header for each token dtype.
DTYPE_CODES = {
    np.dtype(np.uint8): 1,
    np.dtype(np.int8): 2,
    np.dtype(np.int16): 3,
    np.dtype(np.int32): 4,
    np.dtype(np.int64): 5,
    np.dtype(np.float64): 6,
    np.dtype(np.float32): 7,
    np.dtype(np.uint16): 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

_HEADER = struct.Struct("<9sQBQQ")

# Tokens per step of the largest-token-id scan, and sequences per step of the index check: a bounded
# working set for any size of dataset.
_SCAN_CHUNK_TOKENS = 1 << 24
_CHECK_CHUNK_SEQUENCES = 1 << 22


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def smallest_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned/int dtype that holds token ids 0 .. vocab_size - 1.

    Megatron picks uint16 below 65500 tokens and int32 above; we use every id uint16 can hold
    and uint8 for byte-level vocabularies. Megatron reads all three.
    """
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def check_dtype_holds(dtype: np.dtype, vocab_size: int) -> None:
    """Raise if token ids below vocab_size do not all fit in dtype."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPE_CODES or dtype.kind not in "iu":
        raise ValueError(f"token dtype {dtype} is not an integer dtype Megatron's format knows; "
                         f"use one of uint8, uint16, int32, int64")
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise ValueError(f"the tokenizer's vocab ({vocab_size} ids) exceeds dtype {dtype} "
                         f"(max id {np.iinfo(dtype).max}); use a wider --dtype or leave it unset")


_RAW_TEXT_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet", ".arrow")


def missing_prefix_hint(prefix: str) -> str:
    """What the user probably meant by a --data-path entry that names no .bin/.idx pair."""
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix) and os.path.isfile(idx_path(prefix[: -len(suffix)])):
            return f"give the prefix without the suffix: {prefix[: -len(suffix)]}"
    if prefix.endswith(_RAW_TEXT_SUFFIXES):
        return (f"{os.path.basename(prefix)} is raw text: tokenize it with tools/preprocess_data.py --input "
                f"{prefix} --output-prefix OUT, then give OUT_text_document")
    if os.path.isfile(idx_path(prefix + "_text_document")):
        return f"did you mean {prefix}_text_document (what tools/preprocess_data.py writes)?"
    return "give the PREFIX of a PREFIX.bin/PREFIX.idx pair made by tools/preprocess_data.py"


def _map(path: str) -> np.ndarray:
    """The file's bytes, memory-mapped (numpy cannot map an empty file: that one is an empty array)."""
    if os.path.getsize(path) == 0:
        return np.empty(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


class _MappedBin:
    """The .bin's bytes, memory-mapped: a read is a view, the page cache is shared between processes."""

    def __init__(self, path: str):
        self._bytes = _map(path)
        self.size = len(self._bytes)

    def read(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        return np.frombuffer(self._bytes, dtype, count, offset)


class _FileBin:
    """The .bin read with positional reads (pread): no mapping, one system call per read.

    pread keeps no file position, so forked data-loader workers can share the open file.
    """

    def __init__(self, path: str):
        self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - open for the dataset's lifetime
        self.size = os.fstat(self._file.fileno()).st_size

    def read(self, dtype: np.dtype, count: int, offset: int) -> np.ndarray:
        data = os.pread(self._file.fileno(), count * dtype.itemsize, offset)
        if len(data) != count * dtype.itemsize:
            raise DataError(f"{self._file.name} ended at byte {offset + len(data)} while reading {count} tokens "
                            f"from byte {offset}; the file changed after it was opened")
        return np.frombuffer(data, dtype)


def _read_header(index: np.ndarray, name: str) -> tuple[np.dtype, int, int]:
    """(token dtype, sequence count, document count) from the .idx bytes, after checking that the
    header is Megatron's and that the file holds exactly the arrays it announces."""
    if len(index) < _HEADER.size:
        raise DataError(f"{name} is truncated ({len(index)} bytes, shorter than its header); "
                        f"rerun tools/preprocess_data.py")
    magic, version, code, n_seq, n_doc = _HEADER.unpack(index[: _HEADER.size].tobytes())
    if magic != INDEX_MAGIC:
        raise DataError(f"{name} has magic {magic!r}, not {INDEX_MAGIC!r}: not a Megatron MMapIndexedDataset index")
    if version != INDEX_VERSION:
        raise DataError(f"{name} has index version {version}; only version {INDEX_VERSION} is supported")
    if code not in CODE_DTYPES or CODE_DTYPES[code].kind not in "iu":
        known = ", ".join(f"{c} ({d})" for c, d in CODE_DTYPES.items() if d.kind in "iu")
        raise DataError(f"{name} has dtype code {code}, not a token dtype (codes: {known}); the index is damaged")
    expected = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
    if len(index) != expected:
        state = "is truncated" if len(index) < expected else "has trailing bytes"
        raise DataError(f"{name} {state} ({len(index)} bytes; its header announces {n_seq} sequences and "
                        f"{n_doc} document indices, {expected} bytes); rerun tools/preprocess_data.py")
    return CODE_DTYPES[code], n_seq, n_doc


def _dtype_guess(num_bytes: int, num_tokens: int) -> str:
    """' (the size fits int32 tokens)' when a .bin's byte count is the token count times another
    dtype's size: the likely dtype the .bin was written in."""
    if num_tokens == 0 or num_bytes % num_tokens:
        return ""
    names = [str(d) for d in DTYPE_CODES if d.kind in "iu" and d.itemsize == num_bytes // num_tokens]
    return f" (the size fits {' or '.join(names)} tokens)" if names else ""


def _first_misplaced_sequence(lengths: np.ndarray, pointers: np.ndarray, itemsize: int) -> tuple[int, int] | None:
    """(i, where it belongs) for the first sequence whose pointer is not the byte count of the sequences
    before it, or None: Megatron stores sequences back to back. Chunked, so that checking an index of
    100M sequences needs tens of megabytes, not gigabytes."""
    start = 0
    for begin in range(0, len(lengths), _CHECK_CHUNK_SEQUENCES):
        sizes = lengths[begin: begin + _CHECK_CHUNK_SEQUENCES].astype(np.int64) * itemsize
        expected = start + np.cumsum(sizes) - sizes
        wrong = np.flatnonzero(pointers[begin: begin + _CHECK_CHUNK_SEQUENCES] != expected)
        if wrong.size:
            return begin + int(wrong[0]), int(expected[wrong[0]])
        start = int(expected[-1] + sizes[-1])
    return None


class IndexedDataset:
    """Read-only view of `PREFIX.bin`/`PREFIX.idx`: `ds[i]` is sequence i as a numpy view.

    Opening checks that the two files agree (sizes, dtype, pointers), so that a pair that does not
    belong together fails here, naming the file, instead of training on misread tokens.
    """

    def __init__(self, prefix: str, mmap_bin: bool = True):
        for path in (idx_path(prefix), bin_path(prefix)):
            if os.path.isdir(path):
                raise DataError(f"data prefix {prefix!r}: {path} is a directory, not a file")
            if not os.path.isfile(path):
                raise DataError(f"data prefix {prefix!r}: {path} not found; {missing_prefix_hint(prefix)}")
        self.prefix = prefix
        self.mmap_bin = mmap_bin
        try:
            self._index = _map(idx_path(prefix))
            self._bin = _MappedBin(bin_path(prefix)) if mmap_bin else _FileBin(bin_path(prefix))
        except OSError as error:  # no permission, an I/O error
            raise DataError(f"data prefix {prefix!r}: cannot read {error.filename} ({error.strerror})") from None
        self.dtype, n_seq, n_doc = _read_header(self._index, idx_path(prefix))
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(self._index, np.int32, n_seq, offset)
        offset += n_seq * 4
        self.sequence_pointers = np.frombuffer(self._index, np.int64, n_seq, offset)
        offset += n_seq * 8
        self.document_indices = np.frombuffer(self._index, np.int64, n_doc, offset)
        self._check_index_matches_bin()

    def _check_index_matches_bin(self) -> None:
        """Raise DataError unless the .idx describes exactly the tokens of the .bin, back to back.

        The .bin has no header, so a dtype code that differs from how it was written shows only here:
        as a byte count that is not the token count times the dtype's size.
        """
        name, lengths, itemsize = idx_path(self.prefix), self.sequence_lengths, self.dtype.itemsize
        if np.any(lengths < 0):
            raise DataError(f"{name}: sequence {int(np.argmax(lengths < 0))} has a negative length; "
                            f"the index is damaged, rerun tools/preprocess_data.py")
        expected_bytes = self.num_tokens * itemsize
        if self._bin.size != expected_bytes:
            raise DataError(f"{bin_path(self.prefix)} has {self._bin.size} bytes but {name} describes "
                            f"{self.num_tokens} {self.dtype} tokens ({expected_bytes} bytes)"
                            f"{_dtype_guess(self._bin.size, self.num_tokens)}; the .bin and .idx do not "
                            f"belong together: rerun tools/preprocess_data.py")
        misplaced = _first_misplaced_sequence(lengths, self.sequence_pointers, itemsize)
        if misplaced is not None:
            i, expected_pointer = misplaced
            raise DataError(f"{name}: sequence {i} starts at byte {int(self.sequence_pointers[i])} of the .bin, "
                            f"but the sequence lengths place it at byte {expected_pointer}; the "
                            f"index is damaged, rerun tools/preprocess_data.py")
        documents = self.document_indices
        if (len(documents) == 0 or documents[0] != 0 or documents[-1] != len(lengths)
                or not np.all(documents[1:] >= documents[:-1])):
            raise DataError(f"{name}: the document indices are not an increasing run from 0 to the "
                            f"sequence count {len(lengths)}; the index is damaged, rerun tools/preprocess_data.py")

    def token_id_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in the .bin: one pass over the file, a chunk at a time."""
        total = self._bin.size // self.dtype.itemsize
        if total == 0:
            return 0, 0
        smallest, largest = np.iinfo(self.dtype).max, np.iinfo(self.dtype).min
        for start in range(0, total, _SCAN_CHUNK_TOKENS):
            chunk = self._bin.read(self.dtype, min(_SCAN_CHUNK_TOKENS, total - start), start * self.dtype.itemsize)
            smallest, largest = min(smallest, int(chunk.min())), max(largest, int(chunk.max()))
        return smallest, largest

    def __reduce__(self):
        """Pickle the prefix, not the mapped files: a spawned DataLoader worker maps them itself."""
        return IndexedDataset, (self.prefix, self.mmap_bin)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i: a zero-copy view of the mapped .bin, or a
        read-only array read from the file with mmap_bin=False."""
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return self._bin.read(self.dtype, length, start)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


class IndexedDatasetBuilder:
    """Writes a `.bin`/`.idx` pair under temporary names, renamed into place by `finalize`.

    The .bin is renamed before the .idx, and a reader needs the .idx, so a crash at any point
    leaves no pair that looks complete.
    """

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        check_dtype_holds(self.dtype, 1)
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin_tmp = bin_path(prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")  # noqa: SIM115 - open until finalize() or abort()
        self._sequence_lengths: list[int] = []
        self._document_indices: list[int] = [0]

    def add_document(self, tokens) -> None:
        """Append one document, stored as one sequence, to the .bin."""
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {array.max()} does not fit dtype {self.dtype}; "
                             f"use a wider --dtype")
        self._bin.write(array.astype(self.dtype, copy=False).tobytes())
        self._sequence_lengths.append(int(array.size))
        self._document_indices.append(len(self._sequence_lengths))

    def add_row(self, sequences) -> None:
        """Append one document made of several sequences (SFT: a row of conversations)."""
        for sequence in sequences:
            array = np.asarray(sequence)
            self._bin.write(array.astype(self.dtype, copy=False).tobytes())
            self._sequence_lengths.append(int(array.size))
        self._document_indices.append(len(self._sequence_lengths))

    def add_documents(self, tokens: bytes, lengths: np.ndarray) -> None:
        """Append documents given as their tokens back to back, already in this dtype, and their lengths."""
        if len(tokens) != int(lengths.sum(dtype=np.int64)) * self.dtype.itemsize:
            raise ValueError(f"{len(tokens)} bytes of tokens do not hold the {int(lengths.sum())} {self.dtype} "
                             f"tokens of the given lengths")
        self._bin.write(tokens)
        first = len(self._sequence_lengths)
        self._sequence_lengths.extend(lengths.tolist())
        self._document_indices.extend(range(first + 1, len(self._sequence_lengths) + 1))

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at `prefix` (to merge datasets)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix} holds {other.dtype} tokens but the merged output is "
                             f"{self.dtype}; preprocess all inputs with the same tokenizer and --dtype")
        offset = len(self._sequence_lengths)
        self._sequence_lengths.extend(other.sequence_lengths.tolist())
        self._document_indices.extend((other.document_indices[1:] + offset).tolist())
        if len(other):
            self._bin.write(other.get(0, 0, other.num_tokens))

    def finalize(self) -> None:
        """Write the .idx and move both files to their final names."""
        self._bin.close()
        lengths = np.asarray(self._sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        documents = np.asarray(self._document_indices, dtype=np.int64)
        idx_tmp = idx_path(self.prefix) + ".tmp"
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, DTYPE_CODES[self.dtype],
                                 len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Remove the temporary files after a failure."""
        self._bin.close()
        for path in (self._bin_tmp, idx_path(self.prefix) + ".tmp"):
            if os.path.exists(path):
                os.remove(path)
