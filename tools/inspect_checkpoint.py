"""What a checkpoint holds: iteration, the layout it was saved in, consumed samples, tensors with global shapes.

    python tools/inspect_checkpoint.py checkpoints/run1                # the newest complete iteration
    python tools/inspect_checkpoint.py checkpoints/run1 --iteration 200 --all --check

Reads metadata.json and the DCP index only (never unpickling anything but DCP's metadata classes);
--check also verifies every file against the size and CRC-32 recorded when it was saved, then reads every
tensor and reports non-finite values (exit status 1 on either problem).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.checkpoint import checksums, directory  # noqa: E402
from megatron_lite.errors import CheckpointError, UserError  # noqa: E402
from megatron_lite.tool_args import ToolParser, non_negative_int  # noqa: E402

_LAYOUT_KEYS = ("tp", "cp", "dp", "pp", "ep", "etp", "vp")  # etp only where it differs from tp

def resolve(path: str, iteration: int | None) -> str:
    """An iteration directory: `path` itself, or the requested / newest complete one under it."""
    if directory.is_complete(path):
        return path
    if iteration is None:
        iteration = directory.latest_iteration(path)
        if iteration is None:
            raise CheckpointError(f"no complete checkpoint under {path}")
    resolved = directory.checkpoint_path(path, iteration)
    if not directory.is_complete(resolved):
        raise CheckpointError(f"{resolved} is not a complete checkpoint")
    return resolved


def _natural(key: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def describe(path: str, show_all: bool) -> list[str]:
    from megatron_lite.checkpoint.checkpointing import stored_bytes  # torch: once the flags are read
    from megatron_lite.checkpoint.planner import SafeFileSystemReader

    saved = directory.read_metadata(path)
    stored = SafeFileSystemReader(path).read_metadata()
    layout = dict(saved.get("layout", {}))
    if layout.get("etp") == layout.get("tp"):  # experts split as the dense layers: nothing to say
        layout.pop("etp", None)
    lines = [f"checkpoint        {os.path.abspath(path)}",
             f"iteration         {saved['iteration']}",
             f"consumed samples  {saved['consumed_samples']}",
             "saved in layout   " + " x ".join(f"{k.upper()}{layout[k]}" for k in _LAYOUT_KEYS
                                                if layout.get(k) is not None),
             f"optimizer         {saved.get('optimizer', {})}",
             f"saved at          {saved.get('saved_at')}  with {saved.get('versions')}",
             f"size on disk      {stored_bytes(stored) / 1e6:.1f} MB"]
    tensors = stored.state_dict_metadata
    groups = {"model": [], "optimizer": [], "rng_state": []}
    for key in sorted(tensors, key=_natural):
        group = key.split(".")[0] if key.split(".")[0] in ("optimizer", "rng_state") else "model"
        groups[group].append(key)
    for group, keys in groups.items():
        numel = sum(math.prod(tensors[k].size) for k in keys)
        lines.append(f"{group}: {len(keys)} tensors, {numel:,} elements")
        if group == "model" or show_all:
            for key in keys:
                md = tensors[key]
                lines.append(f"  {key:<60} {str(tuple(md.size)):<16} {str(md.properties.dtype):<15} "
                             f"{len(md.chunks)} chunk{'s' * (len(md.chunks) != 1)}")
    return lines


def verify_files(path: str) -> str:
    """One line on the files' checksums; exits with status 1 when a file does not match."""
    records = directory.read_metadata(path).get("files")
    if records is None:
        return "checksums: none recorded (saved before checkpoints had them)"
    damage = checksums.damaged_file(path, records, sorted(records))
    if damage is not None:
        print(f"checksums: {damage}", flush=True)
        sys.exit(1)
    return f"checksums: {len(records)} files match their checksums"


def main(argv=None) -> None:
    parser = ToolParser(prog="inspect_checkpoint.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a --save directory, or one of its iter_XXXXXXX directories")
    parser.add_argument("--iteration", type=non_negative_int, help="which iteration (default: the newest complete one)")
    parser.add_argument("--all", action="store_true", help="also list optimizer and RNG tensors")
    parser.add_argument("--check", action="store_true",
                        help="verify every file's checksum, then read every tensor and check it is finite")
    args = parser.parse_args(argv)
    try:
        show(args)
    except (UserError, OSError) as error:  # a damaged metadata.json or DCP index, an unreadable file
        sys.exit(f"inspect_checkpoint.py: error: {error}")


def show(args) -> None:
    """Print what the checkpoint holds (and, with --check, whether its files and tensors are sound)."""
    path = resolve(args.path, args.iteration)
    print("\n".join(describe(path, args.all)))
    if args.check:
        print(verify_files(path))
        from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors

        tensors = read_checkpoint_tensors(path)
        bad = [k for k, t in tensors.items() if t.is_floating_point() and not t.isfinite().all()]
        print(f"read {len(tensors)} tensors: " + (f"non-finite values in {bad}" if bad else "all finite"))
        if bad:
            sys.exit(1)


if __name__ == "__main__":
    main()
