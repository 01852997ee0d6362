"""The safetensors file format, read and written one tensor at a time, so that no file is ever held whole.

A file is an 8-byte little-endian header length, a JSON header giving every tensor's dtype, shape and byte
range, then the bytes. Reading: `read_header` parses the header of a file that `safe_open` has already
accepted, and `read_tensor` reads one tensor's bytes with plain reads into memory of its own. Not
safe_open's get_tensor: that returns views of a memory map whose touched pages stay resident (and count in
the process's RSS) until the file is closed, so converting a 5 GB shard tensor by tensor would end up
holding the whole shard. Freeing a tensor read here gives its memory back at once.

Writing: `file_layout` places the tensors as safetensors' save_file does (by dtype, widest first, then by
name, which keeps every tensor aligned to its element size), so the header can be written before any tensor
exists, and `StreamedFile` writes each tensor at its offset when it arrives, in any order. The finished file
equals save_file's byte for byte (tests/test_convert_streaming.py checks it), so every safetensors reader
takes it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from megatron_lite.hf.configs import ConversionError

# safetensors' dtype names, in the order of its Dtype enum (save_file puts the highest first)
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
           "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
           "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
           "F64": torch.float64, "I64": torch.int64, "U64": torch.uint64}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_RANK = {name: rank for rank, name in enumerate(_DTYPES)}
_LENGTH = struct.Struct("<Q")
_ALIGNMENT = 8  # save_file pads the header with spaces to a multiple of 8 bytes


@dataclass(frozen=True)
class Entry:
    """Where one tensor of a file is: its dtype and shape, the file offset of its first byte and its size."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


def read_header(path: str) -> dict[str, Entry]:
    """Every tensor of safetensors file `path` (already opened once by safe_open, which validates the header)."""
    with open(path, "rb") as f:
        (length,) = _LENGTH.unpack(f.read(_LENGTH.size))
        header = json.loads(f.read(length))
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ConversionError(f"{path}: tensor '{name}' has dtype {info['dtype']}, which is not converted")
        begin, end = info["data_offsets"]
        entries[name] = Entry(_DTYPES[info["dtype"]], tuple(info["shape"]), _LENGTH.size + length + begin, end - begin)
    return entries


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def read_tensor(path: str, entry: Entry) -> torch.Tensor:
    """One tensor of a file, read into fresh memory (the file is not mapped)."""
    tensor = torch.empty(entry.shape, dtype=entry.dtype)
    if tensor.numel() * tensor.element_size() != entry.nbytes:
        raise ConversionError(f"{path}: a tensor of shape {entry.shape} and dtype {entry.dtype} takes "
                              f"{tensor.numel() * tensor.element_size()} bytes, the header gives it {entry.nbytes}")
    view, done = _bytes_of(tensor), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(entry.start)
        while done < entry.nbytes:
            count = f.readinto(view[done:])
            if not count:
                raise ConversionError(f"weights file {path} ends inside a tensor (cut short?)")
            done += count
    return tensor


def file_layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> tuple[bytes, dict[str, int]]:
    """The header save_file writes for `tensors` (meta tensors will do: only shapes and dtypes count), and the
    file offset of each tensor's bytes."""
    order = sorted(tensors, key=lambda name: (-_RANK[dtype_name(tensors[name].dtype)], name))
    header, offsets, position = ({"__metadata__": metadata} if metadata else {}), {}, 0
    for name in order:
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                        "data_offsets": [position, position + nbytes]}
        offsets[name] = position
        position += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % _ALIGNMENT)
    head = _LENGTH.pack(len(text)) + text
    return head, {name: len(head) + offset for name, offset in offsets.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise ConversionError(f"safetensors files cannot hold {dtype} tensors")
    return _NAMES[dtype]


class StreamedFile:
    """A safetensors file whose header is written first and whose tensors are written as they come, each once;
    it is whole when `complete`."""

    def __init__(self, path: str, layout: dict[str, torch.Tensor], metadata: dict[str, str] | None = None):
        self.path, self.layout = path, layout
        head, self.offsets = file_layout(layout, metadata)
        self.pending = set(layout)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._write_at(memoryview(head), 0)

    def _write_at(self, data: memoryview, offset: int) -> None:
        while data:
            count = os.pwrite(self.fd, data, offset)
            data, offset = data[count:], offset + count

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.layout[name]
        if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
            raise ConversionError(f"'{name}' is {tuple(tensor.shape)} {tensor.dtype}; {self.path} was laid out for "
                                  f"{tuple(expected.shape)} {expected.dtype}")
        if name not in self.pending:
            raise ConversionError(f"'{name}' was written to {self.path} twice")
        self._write_at(_bytes_of(tensor.detach().cpu().contiguous()), self.offsets[name])
        self.pending.discard(name)

    @property
    def complete(self) -> bool:
        return not self.pending

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
