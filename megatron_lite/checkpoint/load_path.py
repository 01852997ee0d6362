"""What --load names: a checkpoint directory (DIR holding iter_XXXXXXX/ and the tracker), or nothing yet.

A run that finds no checkpoint in --load trains from scratch, which is right for a directory that does
not exist yet or holds no checkpoint (the first run of `--save DIR --load DIR`). Everything else that
exists is refused with the flags that would do what was meant, never taken for an empty directory:
one iteration's directory (which tools/generate.py and the converter accept), a file, a Hugging Face
model, a directory whose only iteration is damaged, or one whose checkpoints lie one level further down.
"""

from __future__ import annotations

import os
import re

from megatron_lite.checkpoint import directory

_ITERATION_NAME = re.compile(r"^iter_(\d{7})$")


def load_problem(root: str) -> str | None:
    """Why `--load root` cannot be resumed from as it is named, or None (a checkpoint directory, or none yet)."""
    if not os.path.exists(root):
        return None
    if not os.path.isdir(root):
        return f"--load {root} is a file; name the checkpoint directory (the one holding iter_XXXXXXX/)"
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
