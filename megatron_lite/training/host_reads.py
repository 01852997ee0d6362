"""Counting the reads of tensor values by the host: each one stalls the host until a GPU catches up.

Every `.item()`, `.tolist()`, `float(t)`, `int(t)`, `bool(t)` of a CUDA tensor waits for the device. On the
CPU they cost nothing, so tests and benchmarks count them instead of timing them. Only these Python-level reads
are counted: an op that synchronises inside torch on CUDA (nonzero, boolean-mask indexing, an output sized by
its data, `.to("cpu")`) is not seen here; `torch.cuda.set_sync_debug_mode("error")` finds those on a GPU.
"""

from __future__ import annotations

import contextlib

import torch

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def counted_device_reads(counts: list[str], host_tensors: list[torch.Tensor] = ()):
    """Record every call of a torch.Tensor method that copies a value to the host, while inside the block,
    except on `host_tensors`, which live on the host on every device (Adam's step counters)."""
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    exempt = {id(t) for t in host_tensors}

    def counting(name):
        def read(self, *args, **kwargs):
            if id(self) not in exempt:
                counts.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
