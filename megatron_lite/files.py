"""The small side files a run or a tool reads, and the places it writes, with one line for what is wrong.

A tracker, a metadata.json, a tokenizer_config.json or a --data-args-path file can be missing, a directory,
unreadable, binary, empty, cut short or of the wrong shape. Each reader here turns every one of those into
the caller's UserError subclass (DataError, CheckpointError, ConversionError, ...) with a message that names
the file and says what is wrong, instead of a traceback from inside `json` or a KeyError far from the file.
"""

from __future__ import annotations

import json
import os
import socket
from typing import NamedTuple

from megatron_lite.errors import UserError

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}


def _name(path: str, what: str) -> str:
    return f"{what} {path}" if what else str(path)


def read_bytes(path: str, error: type[Exception], what: str = "") -> bytes:
    """The bytes of file `path`; `error` (one line naming it) when it is missing, a directory or unreadable.
    `what` says which file it is (a flag such as "--data-args-path", or "")."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as problem:  # not found, a directory, no permission, an I/O error: strerror says which
        raise error(f"{_name(path, what)}: cannot read it ({problem.strerror})") from None


def read_text(path: str, error: type[Exception], what: str = "") -> str:
    """The UTF-8 text of file `path`, or `error` saying why it is not text (binary, another encoding)."""
    raw = read_bytes(path, error, what)
    if b"\x00" in raw:  # no text encoding a side file uses writes NUL bytes; binary formats are full of them
        raise error(f"{_name(path, what)}: a binary file, not text (a NUL byte at byte {raw.index(0)})")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as problem:
        raise error(f"{_name(path, what)}: not UTF-8 text (byte {problem.start} is "
                    f"{raw[problem.start:problem.start + 1]!r}); is it a binary file?") from None


def read_json(path: str, error: type[Exception], what: str = ""):
    """The JSON value in file `path`, or `error` saying why there is none (empty, cut short, not JSON)."""
    text = read_text(path, error, what)
    if not text.strip():
        raise error(f"{_name(path, what)}: empty, where JSON was expected")
    try:
        return json.loads(text)
    except json.JSONDecodeError as problem:
        # The parser reached the end of the file (an open string runs to it): the file was cut short.
        ended = problem.pos >= len(text.rstrip()) or problem.msg.startswith("Unterminated string")
        cut = "; the file ends early (cut short?)" if ended else ""
        raise error(f"{_name(path, what)}: not valid JSON (line {problem.lineno} column {problem.colno}: "
                    f"{problem.msg.removesuffix(' starting at')}){cut}") from None


def read_json_object(path: str, error: type[Exception], what: str = "") -> dict:
    """The JSON object (a dict) in file `path`, or `error` saying what the file holds instead."""
    value = read_json(path, error, what)
    if not isinstance(value, dict):
        raise error(f"{_name(path, what)}: holds {type_name(value)}, not a JSON object")
    return value


def type_name(value) -> str:
    """How a JSON value's type reads in an error: 'a list', 'an integer', 'null'."""
    return next((name for kind, name in _TYPE_NAMES.items() if isinstance(value, kind)), type(value).__name__)


def is_a(value, kind) -> bool:
    """Whether a JSON value is of `kind` (int never accepts a bool; float accepts an int)."""
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def check_fields(record: dict, required: dict, optional: dict, where: str, error: type[Exception]) -> None:
    """`error` naming `where` (a file, or a key in one) when a key of `required` is missing or a key of either
    mapping holds a value of another type than the one it maps to (a type, or a tuple of types)."""
    for key, kind in {**required, **optional}.items():
        if key not in record:
            if key in required:
                raise error(f"{where} has no '{key}'")
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not any(is_a(record[key], k) for k in kinds):
            expected = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
            raise error(f"{where}: '{key}' is {type_name(record[key])} {json.dumps(record[key])[:40]}, "
                        f"expected {expected}")


class OutputPathError(UserError, OSError):
    """A location the run would write cannot be written; the message names the flag, the path and the host."""


class Location(NamedTuple):
    flag: str
    path: str
    is_file: bool  # a file the run creates or appends to; else a directory it writes files into


def unwritable(location: Location) -> str | None:
    """Why this process cannot write `location` (its directories are made if missing), or None."""
    why = why_unwritable(location.path, location.is_file, create=True)
    if why is None:
        return None
    return f"{location.flag} {location.path} cannot be written on {socket.gethostname()}: {why}"


def why_unwritable(path: str, is_file: bool, create: bool = False) -> str | None:
    """What keeps this process from writing `path` (a file, or a directory to write files into), or None.
    With `create`, missing directories are made and a probe file written and removed; without, nothing is
    made: the nearest existing directory must accept new entries (for a tool that checks before working)."""
    directory = os.path.dirname(os.path.abspath(path)) if is_file else path
    if is_file and os.path.isdir(path):
        return "it is a directory; name a file"
    if not is_file and os.path.exists(path) and not os.path.isdir(path):
        return "it is a file; name a directory"
    blocking = _file_on_the_way(directory)
    if blocking is not None:
        return f"{blocking} is a file, not a directory"
    if is_file and os.path.exists(path) and not os.access(path, os.W_OK):
        return "the file is read-only"
    if not create:
        nearest = _nearest_existing(directory)
        return None if os.access(nearest, os.W_OK | os.X_OK) else f"{nearest} does not accept new files"
    probe = os.path.join(directory, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "w") as f:
            f.write("probe\n")
        os.remove(probe)
    except OSError as error:
        return error.strerror or str(error)
    return None


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _file_on_the_way(directory: str) -> str | None:
    """The existing non-directory among `directory` and its parents, if any: no directory can be made there."""
    nearest = _nearest_existing(directory)
    return None if os.path.isdir(nearest) else nearest
