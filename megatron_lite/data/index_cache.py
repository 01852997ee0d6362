"""On-disk cache of dataset index arrays, built once by one process while the others wait.

Arrays are stored as `HASH-CLASS-NAME.npy` beside `HASH-CLASS-description.json`, where HASH is
the md5 of the description (everything the arrays depend on) and CLASS its "class" entry.
Every file is written under a temporary name and renamed; the description is renamed last,
so its presence means the arrays are complete and can be read without a lock. Building is
guarded by a file lock rather than a torch.distributed barrier, which keeps the data code
free of process groups and also serialises independent jobs that share a cache directory.
"""

import hashlib
import json
import os
from collections.abc import Callable

import numpy as np
from filelock import FileLock

from megatron_lite.errors import DataError


def default_cache_dir(prefix: str) -> str:
    """`cache/` beside the dataset, Megatron's default place for its index files."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


def description_hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


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
    key = f"{description_hash(description)}-{description['class']}"
    marker = os.path.join(cache_dir, f"{key}-description.json")
    if not os.path.isfile(marker):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            lock = FileLock(os.path.join(cache_dir, f"{key}.lock"))
            with lock:
                if not os.path.isfile(marker):
                    _save(cache_dir, key, build(), description, marker)
        except PermissionError as error:
            raise DataError(f"cannot write the dataset index cache in {cache_dir} ({error.strerror}); "
                            f"give a writable folder with --data-cache-path") from None
    with open(marker, encoding="utf-8") as f:
        names = json.load(f)["arrays"]
    return {name: np.load(os.path.join(cache_dir, f"{key}-{name}.npy"), mmap_mode="r") for name in names}


def _save(cache_dir: str, key: str, arrays: dict[str, np.ndarray], description: dict, marker: str) -> None:
    for name, array in arrays.items():
        _atomic_save(os.path.join(cache_dir, f"{key}-{name}.npy"), lambda f, a=array: np.save(f, a))
    record = {"description": description, "arrays": list(arrays)}
    _atomic_save(marker, lambda f: f.write(json.dumps(record, indent=2, sort_keys=True).encode()))
