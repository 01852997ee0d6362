"""Small indexed corpora written in a test's tmp_path, whose token ids say which corpus they came from."""

import numpy as np

from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder


def make_prefix(tmp_path, name: str, first_token: int, documents: int, dtype=np.int32) -> str:
    """`documents` documents whose token ids all lie in [first_token, first_token + 1000); the prefix."""
    lengths = np.random.default_rng(first_token).integers(20, 80, size=documents)
    builder = IndexedDatasetBuilder(str(tmp_path / name), dtype)
    for n in lengths:
        builder.add_document(first_token + np.arange(n) % 1000)
    builder.finalize()
    return str(tmp_path / name)
