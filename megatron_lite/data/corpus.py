"""Reads raw-text corpora (jsonl, json, parquet, arrow, txt, save_to_disk folders).

JSON lines are read directly, in byte ranges that worker processes can read in parallel. Every
other format goes through the `datasets` library (memory-mapped Arrow, read in C++). This module
resolves paths, checks the requested columns, and turns a reader failure into a line that names
the file and line to fix. A .txt file is one document.
"""

import json
import os

from megatron_lite.errors import DataError

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}


def _format_of(path: str) -> str:
    extension = os.path.splitext(path)[1].lower()
    if extension not in _FORMATS:
        raise ValueError(f"{path}: unsupported input type {extension!r}; inputs are "
                         f"{', '.join(_FORMATS)} files or a datasets.save_to_disk folder")
    return _FORMATS[extension]


def _is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "state.json"))
                                    or os.path.isfile(os.path.join(path, "dataset_dict.json")))


def resolve_inputs(inputs: list[str]) -> tuple[str, list[str]]:
    """(format, files) for the given files and folders; all inputs must share one format."""
    files = []
    for path in inputs:
        if not os.path.exists(path):
            raise FileNotFoundError(f"input {path} not found; check --input")
        if _is_saved_dataset(path):
            if len(inputs) > 1:
                raise ValueError(f"{path} is a save_to_disk folder; pass it as the only --input")
            return "saved", [path]
        if os.path.isdir(path):
            found = sorted(os.path.join(path, name) for name in os.listdir(path)
                           if os.path.splitext(name)[1].lower() in _FORMATS)
            if not found:
                raise FileNotFoundError(f"input folder {path} holds no {', '.join(_FORMATS)} files")
            files.extend(found)
        else:
            files.append(path)
    formats = {_format_of(f) for f in files}
    if len(formats) > 1:
        raise ValueError(f"inputs mix formats {sorted(formats)}; preprocess each format separately "
                         f"and join the outputs with tools/merge_datasets.py")
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"every input file is empty ({', '.join(files)}); there are no documents to preprocess")
    return formats.pop(), files


class Corpus:
    """The documents of some input files, read in batches of text columns."""

    def __init__(self, dataset, kind: str, files: list[str]):
        self.dataset = dataset
        self.kind = kind
        self.files = files

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(self, keys: list[str], batch_size: int):
        """Dicts {key: [text, ...]} of up to batch_size documents, in input order."""
        try:
            yield from self.dataset.select_columns(keys).iter(batch_size=batch_size)
        except UnicodeDecodeError:
            # The json reader keeps invalid bytes; they fail only when a batch becomes str.
            for file in self.files:
                raise_first_bad_line(file, self.kind)
            raise


def load_corpus(inputs: list[str], keys: list[str], cache_dir: str | None = None) -> Corpus:
    """The documents of `inputs`, checked to hold the text columns `keys`."""
    kind, files = resolve_inputs(inputs)
    import datasets

    if kind == "saved":
        dataset = datasets.load_from_disk(files[0])
        if isinstance(dataset, datasets.DatasetDict):
            dataset = datasets.concatenate_datasets(list(dataset.values()))
    else:
        options = {"sample_by": "document"} if kind == "text" else {}
        try:
            dataset = datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir,
                                            **options)
        except Exception:
            for file in files:
                raise_first_bad_line(file, kind)
            raise
    for key in keys:
        if key not in dataset.column_names:
            raise ValueError(f"--json-keys {key!r} is not a column of {', '.join(inputs)} "
                             f"(columns: {', '.join(dataset.column_names)})")
        dtype = dataset.features[key]
        if getattr(dtype, "dtype", None) not in ("string", "large_string"):
            raise ValueError(f"column {key!r} of {', '.join(inputs)} holds {dtype}, not text; "
                             f"choose a text column with --json-keys")
    return Corpus(dataset, kind, files)


def jsonl_files(inputs: list[str]) -> list[str] | None:
    """The files of `inputs` when all are JSON lines (json files not holding an array), else None.

    Such files can be read in byte ranges, in parallel, without converting them to Arrow first.
    """
    kind, files = resolve_inputs(inputs)
    if kind != "json":
        return None
    for path in files:
        with open(path, "rb") as f:
            if f.read(4096).lstrip().startswith(b"["):
                return None
    return files


def check_jsonl_keys(files: list[str], keys: list[str]) -> None:
    """Raise ValueError when the first record of the first non-empty file lacks a text column of `keys`."""
    for path in files:
        with open(path, "rb") as f:
            line = next((raw for raw in f if raw.strip()), None)
        if line is None:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise_first_bad_line(path, "json")
            raise
        for key in keys:
            if key not in record:
                raise ValueError(f"--json-keys {key!r} is not a column of {path} (columns: {', '.join(record)})")
            if record[key] is not None and not isinstance(record[key], str):
                raise ValueError(f"column {key!r} of {path} holds {type(record[key]).__name__}, not text; "
                                 f"choose a text column with --json-keys")
        return


def jsonl_ranges(files: list[str], range_bytes: int) -> list[tuple[str, int, int]]:
    """(path, start, end) byte ranges of about `range_bytes` covering the files, in input order; a
    line belongs to the range its first byte lies in (see read_jsonl_range)."""
    ranges = []
    for path in files:
        size = os.path.getsize(path)
        ranges += [(path, start, min(start + range_bytes, size)) for start in range(0, size, range_bytes)]
    return ranges


def read_jsonl_range(path: str, start: int, end: int, keys: list[str]):
    """{key: text or None} of each record whose line starts in bytes [start, end) of `path`.

    Raises ValueError (or UnicodeDecodeError) at a malformed line; raise_first_bad_line names it.
    """
    with open(path, "rb") as f:
        if start:
            f.seek(start - 1)
            f.readline()  # the rest of the line that byte start - 1 lies in belongs to the range before
        position = f.tell()
        while position < end:
            line = f.readline()
            if not line:
                return
            position += len(line)
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"{path}: a jsonl line must be an object")
                yield {key: record.get(key) for key in keys}


def raise_first_bad_line(path: str, kind: str) -> None:
    """Raise ValueError naming the first line of `path` that is not UTF-8 (or not JSON)."""
    if kind not in ("json", "text"):
        return
    with open(path, "rb") as f:
        first = f.read(4096).lstrip()
        f.seek(0)
        if kind == "json" and first.startswith(b"["):
            return _check_json_array(path, f.read())
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_number}: bytes that are not UTF-8 "
                                 f"({raw[error.start:error.end]!r}); re-encode the file as UTF-8") from None
            if kind == "json" and line.strip():
                _check_json_line(path, line_number, line)


def _check_json_line(path: str, line_number: int, line: str) -> None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{line_number}: malformed JSON line ({error.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{line_number}: a jsonl line must be an object, got {type(record).__name__}")


def _check_json_array(path: str, raw: bytes) -> None:
    try:
        json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}:{line}: bytes that are not UTF-8 ({raw[error.start:error.end]!r}); "
                         f"re-encode the file as UTF-8") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from None
