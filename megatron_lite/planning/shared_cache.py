"""Results an enumeration of layouts computes once and shares: the planner meets tens of thousands of layouts
(DeepSeek-V3 on 1,024 GPUs) that hold the same chunks and the same model.

Inside `shared_results()` (planning.layouts.enumerate_plans):
  `shared(key, build)`            one result per key, for what depends on a part of the layout only (a chunk's
                                  bucket cut: on the model, tp, ep, etp, ...), the key saying which part
  `per_config(config, name, ...)` one result per configuration object, for what several stages of a layout
                                  share; held for the last configuration only, which the enumeration builds,
                                  plans and drops without changing it
Outside, every call builds its own result, so a configuration changed between two calls is never served a
stale one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

from megatron_lite.config.sections import Config

T = TypeVar("T")

_results: dict | None = None
_last_config: dict = {}  # name -> (configuration, result), inside shared_results only
_KEPT = 8192  # results beyond this drop the oldest: an enumeration meets a chunk's layouts close together
_NOT_IN_SHAPES = ("recompute_granularity", "recompute_method", "recompute_num_layers")


@contextlib.contextmanager
def shared_results():
    """Share results between the calls made inside (not re-entrant across threads)."""
    global _results
    previous, _results = _results, {}
    try:
        yield
    finally:
        _results = previous
        _last_config.clear()


def shared(key: tuple, build: Callable[[], T]) -> T:
    """build(), computed once per key inside shared_results."""
    if _results is None:
        return build()
    if key not in _results:
        if len(_results) >= _KEPT:
            del _results[next(iter(_results))]
        _results[key] = build()
    return _results[key]


def per_config(config: Config, name: str, build: Callable[[], T]) -> T:
    """build(), computed once for the configuration object `config` inside shared_results."""
    if _results is None:
        return build()
    held = _last_config.get(name)
    if held is None or held[0] is not config:
        held = _last_config[name] = (config, build())
    return held[1]


def shapes_key(config: Config) -> tuple:
    """What the parameter shapes depend on: the model (recomputation aside), tp, ep and etp."""
    def build():
        p = config.parallel
        model = repr([item for item in vars(config.model).items() if item[0] not in _NOT_IN_SHAPES])
        return (model, p.tensor_model_parallel_size, p.expert_model_parallel_size,
                p.expert_tensor_parallel_size or p.tensor_model_parallel_size)
    return per_config(config, "shapes_key", build)
