"""What --load names: a checkpoint directory (DIR holding iter_XXXXXXX/ and the tracker), or nothing yet.

A run that finds no checkpoint in --load trains from scratch, which is right for a directory that does
not exist yet or holds no checkpoint (the first run of `--save DIR --load DIR`). Everything else that
exists is refused with the flags that would do what was meant, never taken for an empty directory:
one iteration's directory (which tools/generate.py and the converter accept), a file, a Hugging Face
model, a Megatron-LM checkpoint (converted first, so that its saved flags are mapped and checked once rather
than at every start), a directory whose only iteration is damaged, or one whose checkpoints lie one level
further down.
"""

from __future__ import annotations

import os
import re

from megatron_lite.checkpoint import directory

_ITERATION_NAME = re.compile(r"^iter_(\d{7})$")
_MEGATRON_RANK_DIR = re.compile(r"^mp_rank_\d{2}(_\d{3}){0,2}$")


def load_problem(root: str) -> str | None:
    """Why `--load root` cannot be resumed from as it is named, or None (a checkpoint directory, or none yet)."""
    if not os.path.exists(root):
        return None
    if not os.path.isdir(root):
        return f"--load {root} is a file; name the checkpoint directory (the one holding iter_XXXXXXX/)"
    megatron = _megatron_problem(root)
    if megatron is not None:
        return megatron
    parent, name = os.path.split(os.path.normpath(root))
    match = _ITERATION_NAME.match(name)
    if match:
        return (f"--load {root} is the directory of one iteration; to resume from it pass --load {parent or '.'} "
                f"--ckpt-step {int(match.group(1))}")
    if directory.complete_iterations(root) or os.path.exists(os.path.join(root, directory.TRACKER_FILE)):
        return None
    if os.path.isfile(os.path.join(root, "config.json")):
        return (f"--load {root} holds a Hugging Face model, not a megatron_lite checkpoint: convert it with "
                f"tools/convert_checkpoint.py --direction hf-to-mlite --load-dir {root} --save-dir DIR, then "
                f"--load DIR")
    damaged = sorted(name for name in os.listdir(root) if _ITERATION_NAME.match(name))
    if damaged:
        return (f"--load {root} holds {damaged[-1]}, but it is not a complete checkpoint (no metadata.json or "
                f".metadata): it was damaged; remove it to train from scratch")
    nested = sorted(entry.path for entry in os.scandir(root)
                    if entry.is_dir() and directory.complete_iterations(entry.path))
    if nested:
        return f"--load {root} holds no checkpoint, but {nested[0]} does: pass --load {nested[0]}"
    return None


def _megatron_problem(root: str) -> str | None:
    """The conversion command for a Megatron-LM checkpoint (a --save directory or one iteration of it)."""
    iterations = [root, *(os.path.join(root, name) for name in sorted(os.listdir(root))
                          if _ITERATION_NAME.match(name) or name == "release")]
    if not any(_is_megatron_iteration(path) for path in iterations):
        return None
    return (f"--load {root} is a Megatron-LM checkpoint: convert it with tools/convert_checkpoint.py --direction "
            f"megatron-to-mlite --load-dir {root} --save-dir DIR, then continue with --config DIR/config.yaml "
            f"--load DIR")


def _is_megatron_iteration(path: str) -> bool:
    """torch_dist (common.pt beside the DCP files) or the torch format (mp_rank_TT[_PPP] directories)."""
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, "common.pt")) or any(
        _MEGATRON_RANK_DIR.match(name) for name in os.listdir(path))
