"""Byte sizes as save_pretrained's max_shard_size writes them (5GB, 500MB, 2GiB, or a number of bytes).

Without torch, so that tools/convert_checkpoint.py reads --max-shard-size (and answers a mistake in it, or
--help) before importing torch.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes; a ValueError saying how to write one otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
