"""Every kind of token mixer and MLP, one module each (the module config/kinds/ names for it): a transformer layer
builds its parts from these tables, the planner counts their saved bytes and the MFU their FLOPs (kind.py says what
each entry supplies). A new kind is its module and its entry in config/kinds/."""

from __future__ import annotations

import importlib

from megatron_lite.config.kinds import KINDS
from megatron_lite.model.kinds.kind import Kind, LayerParts

_BUILT = {kind.name: (kind.part, importlib.import_module(kind.model).KIND) for kind in KINDS}
MIXERS: dict[str, Kind] = {name: built for name, (part, built) in _BUILT.items() if part == "mixer"}
MLPS: dict[str, Kind] = {name: built for name, (part, built) in _BUILT.items() if part == "mlp"}

__all__ = ["MIXERS", "MLPS", "Kind", "LayerParts"]
