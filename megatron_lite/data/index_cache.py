"""On-disk cache of dataset index arrays, built once by one process while the others wait.

Arrays are stored as `HASH-CLASS[-SPLIT]-NAME.npy` beside `HASH-CLASS[-SPLIT]-description.json`
(Megatron's naming, `SPLIT` when the description has one), where HASH is the md5 of the description
(everything the arrays depend on) together with INDEX_FORMAT, the version of the algorithms that build
them: changing how any index is built bumps INDEX_FORMAT, so caches written by earlier code are not
read. Every file is written under a temporary name and renamed; the description is renamed last,
so its presence means the arrays are complete and can be read without a lock; a description or
array that cannot be read (damaged on disk) is rebuilt, under the lock, with a warning. Building is
guarded by a file lock rather than a torch.distributed barrier, which keeps the data code
free of process groups and also serialises independent jobs that share a cache directory.
"""

import hashlib
import json
import os
import sys
from collections.abc import Callable

import numpy as np
from filelock import FileLock

from megatron_lite.errors import DataError
from megatron_lite.files import read_json_object


def default_cache_dir(prefix: str) -> str:
    """`cache/` beside the dataset, Megatron's default place for its index files."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


# 2: Megatron-Core's multi-epoch document shuffle, separate-final-epoch threshold and greedy blending
INDEX_FORMAT = 2


def description_hash(description: dict) -> str:
    """md5 of the description and INDEX_FORMAT."""
    record = {"description": description, "index_format": INDEX_FORMAT}
    return hashlib.md5(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _atomic_save(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def load_or_build(cache_dir: str, description: dict, build: Callable[[], dict[str, np.ndarray]]
                  ) -> dict[str, np.ndarray]:
    """The arrays for `description`: read from `cache_dir`, or made by `build()` and saved there.

    Loaded arrays are memory-mapped, so many data-loader workers share one copy in the page cache.
    """
    key = "-".join([description_hash(description), description["class"]]
                   + ([description["split"]] if "split" in description else []))
    marker = os.path.join(cache_dir, f"{key}-description.json")
    arrays = _load(cache_dir, key, marker)
    if arrays is not None:
        return arrays
    damaged = os.path.lexists(marker)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = FileLock(os.path.join(cache_dir, f"{key}.lock"))
        lock.acquire()
    except OSError as error:  # no permission, no space, a file in the folder's place
        raise _unwritable(cache_dir, marker, damaged, error) from None
    try:
        if _load(cache_dir, key, marker) is None:  # else another process built it while this one waited
            if os.path.lexists(marker):
                print(f"warning: the dataset index cache {marker} (or an array it lists) is damaged; rebuilding it",
                      file=sys.stderr, flush=True)
            arrays = build()
            try:
                _save(cache_dir, key, arrays, description, marker)
            except OSError as error:
                raise _unwritable(cache_dir, marker, damaged, error) from None
    finally:
        lock.release()
    arrays = _load(cache_dir, key, marker)
    if arrays is None:
        raise DataError(f"the dataset index cache {marker} cannot be read back after it was written; "
                        f"give another folder with --data-cache-path")
    return arrays


def _unwritable(cache_dir: str, marker: str, damaged: bool, error: OSError) -> DataError:
    what = f"rebuild the damaged dataset index cache {marker}" if damaged else \
        f"write the dataset index cache in {cache_dir}"
    return DataError(f"cannot {what} ({error.strerror}); give a writable folder with --data-cache-path")


def _load(cache_dir: str, key: str, marker: str) -> dict[str, np.ndarray] | None:
    """The cached arrays, memory-mapped; None when the marker is missing, or it or an array it lists is
    damaged (not JSON, the wrong shape, a file that is not a whole .npy), so that the cache is rebuilt."""
    if not os.path.isfile(marker):
        return None
    try:
        names = read_json_object(marker, DataError).get("arrays")
        if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
            return None
        return {name: np.load(os.path.join(cache_dir, f"{key}-{name}.npy"), mmap_mode="r") for name in names}
    except (OSError, ValueError, EOFError):  # DataError is a ValueError; numpy raises these for a damaged .npy
        return None


def _save(cache_dir: str, key: str, arrays: dict[str, np.ndarray], description: dict, marker: str) -> None:
    for name, array in arrays.items():
        _atomic_save(os.path.join(cache_dir, f"{key}-{name}.npy"), lambda f, a=array: np.save(f, a))
    record = {"description": description, "index_format": INDEX_FORMAT, "arrays": list(arrays)}
    _atomic_save(marker, lambda f: f.write(json.dumps(record, indent=2, sort_keys=True).encode()))
