"""The errors a user can fix, and how a process reports them: one line on every rank, no traceback.

Every error that means "change your input" (a flag, a data file, a checkpoint directory) derives from
`UserError`. Entry points catch it and print `error (rank R): <message>`; `--debug` or
`MEGATRON_LITE_DEBUG=1` adds the traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback


class UserError(Exception):
    """A problem in the user's input; the message is one line saying what to change."""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message is one line per problem, each saying what to change."""


class DataError(UserError, ValueError):
    """A dataset (or tokenizer file) does not hold what it claims; the message names the file."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message says what to change."""


class TrainingDivergedError(UserError, FloatingPointError):
    """The loss or gradient norm became NaN or infinite; the step was not applied and nothing was saved."""


def debug_requested(argv: list[str] | None = None) -> bool:
    argv = sys.argv[1:] if argv is None else argv
    return "--debug" in argv or os.environ.get("MEGATRON_LITE_DEBUG", "0") not in ("", "0")


def report(error: BaseException, debug: bool = False) -> None:
    """Print `error (rank R): message` to stderr (with the traceback when debugging)."""
    if debug:
        traceback.print_exception(error)
    rank = os.environ.get("RANK", "0")
    message = " ".join(str(error).split("\n"))
    sys.stderr.write(f"error (rank {rank}): {message}\n")  # one write: ranks share the terminal, lines stay whole
    sys.stderr.flush()
