"""Read an offline W&B run file (run-*.wandb) back with wandb's own protobuf record definitions.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
records, each with a 7-byte header (crc32, length, type) where type FULL=1, FIRST=2, MIDDLE=3, LAST=4.
"""

import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK, _HEADER = 32768, 7


def read_records(path: str):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _HEADER:
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + _HEADER])
        if kind == 0 and length == 0:
            position += left_in_block
            continue
        pending += data[position + _HEADER:position + _HEADER + length]
        position += _HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): item.value_json for item in items}


def read_run(path: str, timeout_s: float = 60.0) -> dict:
    """{"id", "project", "name", "config": {key: json}, "history": [{key: json}, ...], "summary": {key: json}}
    of one offline run.

    wandb's core process may still be writing the file when `finish()` returns: wait for the exit
    record, which comes last.
    """
    deadline = time.monotonic() + timeout_s
    while not any(r.WhichOneof("record_type") == "exit" for r in read_records(path)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no exit record after {timeout_s}s")
        time.sleep(0.2)
    run = {"history": [], "summary": {}}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, project=record.run.project, name=record.run.display_name,
                       config=_items(record.run.config.update))
        elif kind == "history":
            run["history"].append(_items(record.history.item))
        elif kind == "summary":
            run["summary"].update(_items(record.summary.update))
    return run
