"""What each layer of the network is, read once from whichever flags describe the stack (--hybrid-layer-pattern
sets the per-layer flags it stands for, config/hybrid_layer_pattern.py, and alone places the kinds no other flag
describes, such as Mamba-2): its token mixer, its MLP (or none) and its softmax attention's window. The model
builds each layer from its spec (model/kinds/)."""

from __future__ import annotations

from typing import NamedTuple

from megatron_lite.config import kinds
from megatron_lite.config.hybrid_layer_pattern import parse_hybrid_layer_pattern
from megatron_lite.config.layer_pattern import (
    linear_attention_pattern,
    moe_layer_pattern,
    window_attention_pattern,
)
from megatron_lite.config.sections import ModelConfig

ATTENTION, LATENT_ATTENTION = kinds.ATTENTION.name, kinds.LATENT_ATTENTION.name
GATED_DELTA_NET, MAMBA = kinds.GATED_DELTA_NET.name, kinds.mamba.KIND.name
DENSE, MOE, NO_MLP = kinds.DENSE.name, kinds.MOE.name, kinds.NO_MLP.name


class LayerSpec(NamedTuple):
    mixer: str  # a mixer kind's name (config/kinds/): ATTENTION, LATENT_ATTENTION, GATED_DELTA_NET, MAMBA
    mlp: str  # an MLP kind's name: DENSE, MOE or NO_MLP (a mixer alone)
    window: int | None = None  # keys before the query that softmax attention sees; None: all

    @property
    def routed_experts(self) -> bool:
        """Whether its MLP routes tokens to experts (what expert parallelism splits)."""
        return self.mlp == MOE


def layer_specs(config: ModelConfig) -> list[LayerSpec]:
    """The spec of every decoder layer."""
    softmax = LATENT_ATTENTION if config.multi_latent_attention else ATTENTION
    specs = [LayerSpec(GATED_DELTA_NET if linear else softmax, MOE if moe else DENSE,
                       config.window_size[0] if windowed and not linear else None)
             for linear, moe, windowed in zip(linear_attention_pattern(config), moe_layer_pattern(config),
                                              window_attention_pattern(config))]
    placed = {kind.symbol: kind.name for kind in kinds.KINDS if kind.pattern_only}
    if config.hybrid_layer_pattern is not None and set(config.hybrid_layer_pattern) & set(placed):
        layers = parse_hybrid_layer_pattern(config.hybrid_layer_pattern).layers
        specs = [LayerSpec(placed[layer.mixer], spec.mlp if layer.mlp else NO_MLP) if layer.mixer in placed else spec
                 for spec, layer in zip(specs, layers, strict=True)]
    return specs


def depth_layer_specs(config: ModelConfig, decoder: list[LayerSpec] | None = None) -> list[LayerSpec]:
    """The specs of the layers of one multi-token prediction depth: those the pattern writes after each /, else one
    layer of the last decoder layer's kind, as Megatron builds it from the last layer's spec."""
    decoder = layer_specs(config) if decoder is None else decoder
    pattern = parse_hybrid_layer_pattern(config.hybrid_layer_pattern) if config.hybrid_layer_pattern else None
    if pattern is None or not pattern.depths or list(pattern.depths[0]) == pattern.layers[-1:]:
        return decoder[-1:]
    kinds_by_symbol = kinds.BY_SYMBOL
    return [LayerSpec(kinds_by_symbol[layer.mixer].name, kinds_by_symbol[layer.mlp].name if layer.mlp else NO_MLP)
            for layer in pattern.depths[0]]


def numbered_layer_specs(config: ModelConfig) -> list[LayerSpec]:
    """The spec of every numbered layer: the decoder's, then those of each multi-token prediction depth (numbered
    after the decoder's, depth by depth)."""
    specs = layer_specs(config)
    return specs + depth_layer_specs(config, specs) * (config.mtp_num_layers or 0)


def layer_spec(config: ModelConfig, layer_number: int) -> LayerSpec:
    """The spec of global layer `layer_number`, a decoder or a multi-token prediction layer."""
    return numbered_layer_specs(config)[layer_number]
