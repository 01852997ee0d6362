"""What the command-line tools in tools/ share: a parser whose errors are one line, and argument types that
refuse impossible numbers (a count of zero, a negative size, a share above one) where they are parsed.

argparse prints its usage line above an error; on a terminal shared by many ranks, or in a log, the one line
`tool.py: error: argument --world-size: must be at least 1, got 0` says all there is to change, and --help
has the rest.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from megatron_lite.files import why_unwritable


class ToolParser(argparse.ArgumentParser):
    """argparse with every error on one line, `PROG: error: MESSAGE (see PROG --help)`, and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bounded(kind: type, low: float, high: float | None = None, above_low: bool = False) -> Callable[[str], float]:
    """An argparse type: `kind(text)`, finite, at least `low` (above it with `above_low`) and at most `high`."""
    noun = "an integer" if kind is int else "a number"
    low_text, high_text = (f"{bound:g}" if isinstance(bound, float) else str(bound) for bound in (low, high))
    if high is not None:
        rule = f"must be between {low_text} and {high_text}"
    else:
        rule = f"must be above {low_text}" if above_low else f"must be at least {low_text}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        too_low = value <= low if above_low else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    return parse


positive_int = _bounded(int, 1)
"""A count: 1 or more (ranks, rounds of a drill, tokens to generate, pixels per inch)."""
non_negative_int = _bounded(int, 0)
"""An iteration, or a count where 0 means none or all (as the tool's help says)."""
positive_float = _bounded(float, 0.0, above_low=True)
"""A size, a rate or a length above zero (GiB, GB/s, TFLOP/s, inches)."""
fraction = _bounded(float, 0.0, 1.0)
"""A share from 0 to 1."""
seed = _bounded(int, 0, 2**64 - 1)
"""A random seed: what torch.Generator.manual_seed takes, without its negative aliases."""


def _output(is_file: bool, suffix: str = "") -> Callable[[str], str]:
    """An argparse type for a place the tool will write (`text + suffix`): refused at once, before any work,
    when it cannot be (under a regular file, a directory where a file is meant or the reverse, read-only)."""
    def parse(text: str) -> str:
        why = why_unwritable(text + suffix, is_file)
        if why is not None:
            raise argparse.ArgumentTypeError(f"{text} cannot be written: {why}")
        return text

    return parse


output_file = _output(is_file=True)
"""A file to write."""
output_prefix = _output(is_file=True, suffix=".x")
"""The PREFIX of files to write (PREFIX.bin, PREFIX_text_document.idx, PREFIX.model, ...)."""
output_directory = _output(is_file=False)
"""A directory to write into."""
