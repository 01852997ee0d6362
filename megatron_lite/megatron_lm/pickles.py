"""Megatron-LM's pickled files read without running code: `common.pt` (torch_dist) and `model_optim_rng.pt`.

Both are `torch.save` pickles. They are read with `torch.load(weights_only=True)`, which builds only
tensors, containers and plain values, plus an allow-list of the few other things Megatron-LM stores:
its argparse `Namespace` of flags, its enums (`ModelType`, `AttnBackend`, ...: kept as `MegatronEnum`
values holding the enum's name and value, so megatron-core need not be installed) and numpy arrays of
its RNG states. A pickle naming anything else is refused with one line naming the type; nothing in it is
called.
"""

from __future__ import annotations

import argparse
import re

import numpy
import torch

from megatron_lite.errors import CheckpointError

# Enums Megatron-LM keeps in its flags (megatron/training/arguments.py sets them from strings).
_MEGATRON_ENUMS = ("megatron.core.enums.ModelType", "megatron.core.enums.Fp8Recipe",
                   "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.AttnMaskType",
                   "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.enums.CudaGraphScope")


class MegatronEnum:
    """A Megatron enum member read from a pickle: `qualname` (e.g. megatron.core.enums.ModelType) and `value`."""

    qualname = ""

    def __init__(self, value=None):
        self.value = value

    def __repr__(self) -> str:
        return f"{self.qualname.rsplit('.', 1)[-1]}({self.value!r})"


def _stand_in(qualname: str) -> type[MegatronEnum]:
    return type(qualname.rsplit(".", 1)[-1], (MegatronEnum,), {"qualname": qualname})


def _numpy_array_globals() -> list:
    """What numpy arrays pickle as (Megatron-LM's saved numpy RNG state): their reconstruction and dtypes."""
    multiarray = getattr(numpy, "_core", None) or numpy.core
    dtypes = [type(numpy.dtype(kind)) for kind in ("uint32", "int64", "float64")]
    return [multiarray.multiarray._reconstruct, numpy.ndarray, numpy.dtype, *dtypes]


_ALLOWED = [argparse.Namespace, *_numpy_array_globals(), *((_stand_in(name), name) for name in _MEGATRON_ENUMS)]
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_megatron_pickle(path: str, mmap: bool = False) -> dict:
    """The dict a Megatron-LM `torch.save` wrote to `path`, read with weights_only=True and the allow-list
    (with `mmap`, tensors stay in the file until used)."""
    try:
        with torch.serialization.safe_globals(_ALLOWED):
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the Megatron-LM checkpoint is incomplete") from None
    except Exception as error:  # weights_only refuses with UnpicklingError; a cut file fails in many ways
        found = _GLOBAL.search(str(error))
        if found:
            raise CheckpointError(f"{path} holds a {found.group(1)}, which a Megatron-LM checkpoint does not "
                                  f"store; refusing to unpickle it (it could run code)") from None
        raise CheckpointError(f"{path} cannot be read as a Megatron-LM checkpoint file: "
                              f"{str(error).splitlines()[0][:200]}") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{path} holds a {type(loaded).__name__}, not the dict Megatron-LM saves")
    return loaded
