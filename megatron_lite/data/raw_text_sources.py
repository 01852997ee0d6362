"""Raw-text training sources: which paths are raw text, their chunks, and the records of one chunk.

A source is one --data-path entry: a JSON-lines file (plain, .gz or .zst), a Parquet file, a folder of
such files (its shards, in name order), or a folder written by `datasets.save_to_disk`. It is cut into
chunks that a worker process can read on its own and that are known without reading the corpus:
byte ranges of about --raw-text-chunk-mib of a plain JSON-lines file (a line belongs to the range its
first byte lies in), a whole compressed file (a stream cannot be entered in the middle), a Parquet row
group, or 1024 rows of a saved dataset. A chunk is also the bounded buffer the documents are shuffled in.

A record that cannot be used (not JSON, not an object, no text under the key, text that is not a
string) is yielded as a BadRecord naming the file and line (or row), for the caller to stop on or count.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os

from megatron_lite.errors import DataError

_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
RAW_SUFFIXES = _JSONL_SUFFIXES + (".parquet",)
_SAVED_ROWS_PER_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Records [start, end) of `path`: bytes of a plain jsonl file, rows of a Parquet row group (start is the
    group's first row in the file, `group` its index) or of a saved dataset; a compressed file whole."""

    path: str
    kind: str  # "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "saved"
    start: int = 0
    end: int = 0
    group: int = 0


@dataclasses.dataclass(frozen=True)
class BadRecord:
    """Where a record that cannot be trained on lies (FILE:LINE, or FILE row N) and why."""

    where: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.why}"


def _kind_of(path: str) -> str | None:
    name = path.lower()
    return next((suffix[1:] for suffix in sorted(RAW_SUFFIXES, key=len, reverse=True) if name.endswith(suffix)),
                None)


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name))
                                       for name in ("state.json", "dataset_dict.json"))


def is_raw_text(path: str) -> bool:
    """Whether a --data-path entry names raw text (by its suffix, or a folder of raw files or a saved
    dataset) rather than the prefix of a .bin/.idx pair."""
    if _kind_of(path) is not None or is_saved_dataset(path):
        return True
    return os.path.isdir(path) and any(_kind_of(name) for name in os.listdir(path))


def source_files(path: str) -> list[str]:
    """The files of one source, in the order their chunks are listed; refuses a missing or empty source."""
    if not os.path.exists(path):
        raise DataError(f"raw text source {path} not found; check --data-path")
    if is_saved_dataset(path):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, name) for name in os.listdir(path) if _kind_of(name))
        if not files:
            raise DataError(f"raw text folder {path} holds no {', '.join(RAW_SUFFIXES)} files")
    else:
        files = [path]
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"raw text source {path} is empty; give it documents or leave it out of the blend")
    return files


def list_chunks(path: str, chunk_bytes: int) -> list[Chunk]:
    """Every chunk of the source `path`, from file sizes and metadata alone."""
    chunks = []
    for file in source_files(path):
        kind = "saved" if is_saved_dataset(file) else _kind_of(file)
        if kind == "jsonl":
            size = os.path.getsize(file)
            chunks += [Chunk(file, kind, start, min(start + chunk_bytes, size))
                       for start in range(0, size, chunk_bytes)]
        elif kind == "parquet":
            metadata = _parquet_file(file).metadata
            first = 0
            for group in range(metadata.num_row_groups):
                rows = metadata.row_group(group).num_rows
                chunks.append(Chunk(file, kind, first, first + rows, group))
                first += rows
        elif kind == "saved":
            rows = len(_load_saved(file))
            chunks += [Chunk(file, kind, start, min(start + _SAVED_ROWS_PER_CHUNK, rows))
                       for start in range(0, rows, _SAVED_ROWS_PER_CHUNK)]
        elif os.path.getsize(file):
            chunks.append(Chunk(file, kind))
    if not chunks:
        raise DataError(f"raw text source {path} holds no records; give it documents or leave it out of the blend")
    return chunks


def read_chunk(chunk: Chunk, key: str):
    """The text under `key` of each record of `chunk` in file order, or a BadRecord in its place."""
    if chunk.kind in ("parquet", "saved"):
        yield from _read_table(chunk, key)
        return
    for where, line in _jsonl_lines(chunk):
        yield _text_of_line(where, line, key)


def check_source(path: str, chunks: list[Chunk], key: str) -> None:
    """Refuse a source whose first record has no text under `key`, or that holds no text at all."""
    if chunks[0].kind in ("parquet", "saved"):
        columns = (_parquet_file(chunks[0].path).schema_arrow.names if chunks[0].kind == "parquet"
                   else _load_saved(chunks[0].path).column_names)
        if key not in columns:
            raise DataError(f"--json-keys {key!r} is not a column of {chunks[0].path} (columns: {', '.join(columns)})")
    for chunk in chunks:
        for record in read_chunk(chunk, key):
            if isinstance(record, BadRecord):
                if "no text under" in record.why:
                    raise DataError(f"{record}; name the text column with --json-keys")
                continue
            if record:
                return
    raise DataError(f"raw text source {path} holds no documents with text under {key!r}")


def _text_of_line(where, line: bytes, key: str):
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = getattr(error, "msg", "bytes that are not UTF-8")
        return BadRecord(where(), f"malformed JSON line ({reason})")
    if not isinstance(record, dict):
        return BadRecord(where(), f"a JSON line must be an object, got {type(record).__name__}")
    return _text_of(where, record, key)


def _text_of(where, record: dict, key: str):
    if key not in record:
        return BadRecord(where(), f"no text under --json-keys {key!r} (keys: {', '.join(record)[:80]})")
    text = record[key]
    if not isinstance(text, str):
        return BadRecord(where(), f"{key!r} holds {type(text).__name__}, not text")
    return text


def _jsonl_lines(chunk: Chunk):
    """(where, line) of every non-blank line of a jsonl chunk; `where()` names FILE:LINE (computed only when
    asked: a byte range does not know its first line's number without counting the lines before it)."""
    if chunk.kind == "jsonl":
        with open(chunk.path, "rb") as f:
            if chunk.start:
                f.seek(chunk.start - 1)
                f.readline()  # the line byte start - 1 lies in belongs to the range before
            first_line_start, position, index = f.tell(), f.tell(), 0
            while position < chunk.end:
                line = f.readline()
                if not line:
                    return
                position += len(line)
                index += 1
                if line.strip():
                    yield (lambda i=index: f"{chunk.path}:{_lines_before(chunk.path, first_line_start) + i}"), line
        return
    opened, errors = _open_compressed(chunk)
    number = 0
    with opened as f:
        try:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    yield (lambda n=number: f"{chunk.path}:{n}"), line
        except errors as error:
            raise DataError(f"{chunk.path} cannot be decompressed after line {number} ({error}); replace the file "
                            f"with a complete {chunk.kind.removeprefix('jsonl.')} file or leave it out") from None


def _lines_before(path: str, offset: int) -> int:
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n")


def _open_compressed(chunk: Chunk):
    """The decompressed file, and the errors its reading raises on a damaged file."""
    if chunk.kind == "jsonl.gz":
        return gzip.open(chunk.path, "rb"), (OSError, EOFError)  # BadGzipFile, or a file cut short
    try:
        import zstandard
    except ImportError:
        raise DataError(f"reading {chunk.path} needs the zstandard package: pip install zstandard") from None
    return _ZstdLines(chunk.path, zstandard.ZstdDecompressor()), (zstandard.ZstdError, OSError, EOFError)


class _ZstdLines:
    """The lines of a .zst file, frame after frame; EOFError where the file ends inside a frame (zstandard's
    stream reader ends there without a word, so a file cut short would read as a shorter corpus)."""

    _BLOCK = 1 << 20  # compressed bytes read at a time

    def __init__(self, path: str, decompressor):
        self.path, self.decompressor = path, decompressor

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def __iter__(self):
        frame, pending = self.decompressor.decompressobj(), b""
        with open(self.path, "rb") as f:
            while block := f.read(self._BLOCK):
                data = frame.decompress(block)
                while frame.eof and frame.unused_data:  # the next frame begins in this block
                    rest, frame = frame.unused_data, self.decompressor.decompressobj()
                    data += frame.decompress(rest)
                *lines, pending = (pending + data).split(b"\n")
                yield from (line + b"\n" for line in lines)
        if not frame.eof:
            raise EOFError("the file ends inside a zstd frame: it was cut short")
        if pending:
            yield pending


def _read_table(chunk: Chunk, key: str):
    if chunk.kind == "parquet":
        texts = _parquet_file(chunk.path).read_row_group(chunk.group, columns=[key]).column(key).to_pylist()
    else:
        texts = _load_saved(chunk.path)[chunk.start:chunk.end][key]
    for row, text in enumerate(texts, start=chunk.start):
        yield _text_of(lambda r=row: f"{chunk.path} row {r}", {key: text}, key)


_OPENED: dict[str, object] = {}  # per process: each worker opens a file once, not once per chunk


def _parquet_file(path: str):
    import pyarrow.parquet

    if path not in _OPENED:
        try:
            _OPENED[path] = pyarrow.parquet.ParquetFile(path)
        except Exception as error:  # pyarrow raises ArrowInvalid (and others) for any unreadable file
            raise DataError(f"{path} is not a Parquet file ({error})") from None
    return _OPENED[path]


def _load_saved(path: str):
    import datasets

    if path not in _OPENED:
        try:
            dataset = datasets.load_from_disk(path)
        except (ValueError, KeyError, TypeError, OSError) as error:  # json.JSONDecodeError is a ValueError
            raise DataError(f"{path} looks like a saved dataset (it holds state.json or dataset_dict.json) but "
                            f"cannot be loaded ({type(error).__name__}: {error}); save it again with "
                            f"datasets' save_to_disk, or point --data-path at the raw files") from None
        if isinstance(dataset, datasets.DatasetDict):
            dataset = datasets.concatenate_datasets(list(dataset.values()))
        _OPENED[path] = dataset
    return _OPENED[path]
