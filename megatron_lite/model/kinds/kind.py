"""What the package asks of every kind of layer part (model/kinds/__init__.py holds one per kind)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class LayerParts(NamedTuple):
    """What every part of one transformer layer is built with besides the model's configuration."""

    sequence_parallel: bool
    backend: str  # the attention kernels (model/attention/self_attention.py choose_attention_backend)
    rng_tracker: object
    cp_comm_type: str
    fp8: object  # the layer's FP8Recipe, or None


class Kind(NamedTuple):
    """One kind of token mixer or MLP: how a layer builds it, and what it costs."""

    build: Callable  # (model config, parallel state, global layer number, LayerSpec, LayerParts) -> module
    flops: Callable  # (model config, LayerSpec) -> forward FLOPs per token (model/flops.py sums them)
    saved_bytes: Callable  # (config, LayerSpec) -> bytes one micro-batch saves for backward on one rank
    normed: bool = True  # the layer gives it a pre-norm and a residual (an absent MLP has neither)
