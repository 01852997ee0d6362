"""What the configuration knows of a kind of token mixer or MLP, without torch: its name in the layer specs, its
symbol in --hybrid-layer-pattern, and for a kind that only the pattern places, its flags and their checks. The
registry (config/kinds/__init__.py) lists every kind once; the model's side of each (how a layer builds it, its
FLOPs and saved bytes) is the module `model` names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ConfigKind:
    name: str  # the LayerSpec mixer or mlp value (config/layer_specs.py)
    part: str  # "mixer" or "mlp"
    model: str  # the module of its model kind, which holds KIND (model/kinds/)
    symbol: str | None = None  # in --hybrid-layer-pattern (None: not written there)
    described: str = ""  # the words a message about the pattern uses for it
    alone: bool = False  # a mixer that makes a layer of its own when no MLP follows it
    pattern_only: bool = False  # placed by --hybrid-layer-pattern alone (no per-layer flag describes it)
    section: type | None = None  # the dataclass of its flags, part of ModelConfig
    problems: Callable | None = None  # (Config) -> one line per problem of its flags at this layout
    minimums: dict[str, int] = field(default_factory=dict)  # the smallest value of each of its integer flags
