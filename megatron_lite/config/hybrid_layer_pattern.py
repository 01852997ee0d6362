"""Megatron's --hybrid-layer-pattern: the whole stack in one string, read into the per-layer flags.

One symbol per sublayer, each with its own pre-norm and residual, as in Megatron's hybrid models:

    *  softmax attention      +  multi-latent attention      G  Gated DeltaNet      M  Mamba-2
    -  dense MLP              E  MoE layer
    |  a pipeline stage boundary                             /  before each multi-token prediction depth

A mixer symbol and the MLP symbol after it make one transformer layer here (a GPT layer is "*-"), so a pattern
builds the network its flags would, with the same parameter names: "G-G-|G-*-/*-" is four layers (three Gated
DeltaNet, then softmax attention; dense MLPs) over two pipeline stages, and one MTP depth of one softmax-attention
layer. Megatron repeats one depth's pattern: "M-M-|M-M*-/MM/MM" has two depths of two Mamba-2 layers each.
A Mamba-2 mixer (M) not followed by an MLP is a layer of its own, as in Nemotron-H ("M-M*-" is three layers: M-,
M, *-) and pure Mamba-2 models ("MMMM"). Megatron's D (DeepSeek sparse attention) is not built by this version,
nor another mixer without its MLP or an MLP without its mixer; each is refused with one line.

`apply_hybrid_layer_pattern` sets --num-layers, --moe-layer-freq, --linear-attention-freq,
--multi-latent-attention, --experimental-attention-variant and --mtp-num-layers from the pattern; each of them
given beside it must describe the same network. Under pipeline parallelism the `|` segments are the model chunks
in Megatron's order (flexible virtual pipeline stages): chunk c of stage p is segment c x PP + p, so there must be
PP x (virtual stages) segments, and the virtual stages follow from their number. Without pipeline parallelism `|`
places nothing, so a checkpoint's pattern also describes its network at any other layout.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

from megatron_lite.config.kinds import BY_SYMBOL
from megatron_lite.config.layer_pattern import (
    LayerPatternError,
    layer_list_expression,
    parse_interleaved_freq,
    parse_moe_layer_freq,
)

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config

MIXERS = {symbol: kind.described for symbol, kind in BY_SYMBOL.items() if kind.part == "mixer"}
MLPS = {symbol: kind.described for symbol, kind in BY_SYMBOL.items() if kind.part == "mlp"}
ALONE = {symbol for symbol, kind in BY_SYMBOL.items() if kind.alone}  # mixers that make a layer with no MLP after
NOT_BUILT = {"D": "DeepSeek sparse attention"}
STAGE, DEPTH = "|", "/"


class Layer(NamedTuple):
    """One transformer layer of the pattern: its mixer's symbol and its MLP's (None: a mixer alone)."""

    mixer: str
    mlp: str | None


class HybridPattern(NamedTuple):
    segments: tuple[tuple[Layer, ...], ...]  # the decoder's layers, by `|` segment
    depths: tuple[tuple[Layer, ...], ...]  # the layers of each multi-token prediction depth (all alike)

    @property
    def layers(self) -> list[Layer]:
        return [layer for segment in self.segments for layer in segment]

    @property
    def symbols(self) -> int:
        """The decoder's sublayers, one per symbol (Megatron's --num-layers for the pattern)."""
        return sum(1 + (layer.mlp is not None) for layer in self.layers)


def _layers(text: str) -> tuple[Layer, ...]:
    """The layers of a pattern without `|` or `/`: each mixer with the MLP after it, or alone where it may be."""
    for symbol in text:
        if symbol in NOT_BUILT:
            raise LayerPatternError(f"{symbol} ({NOT_BUILT[symbol]}) layers are not built by this version")
        if symbol not in MIXERS and symbol not in MLPS:
            raise LayerPatternError(f"{symbol!r} is not a layer symbol; use * + G M (mixers), - E (MLPs), | and /")
    layers, start = [], 0
    while start < len(text):
        mixer, mlp = text[start], text[start + 1:start + 2] or None
        if mixer in MIXERS and mlp in MLPS:
            layers.append(Layer(mixer, mlp))
            start += 2
        elif mixer in ALONE:
            layers.append(Layer(mixer, None))
            start += 1
        else:
            raise LayerPatternError(f"at symbol {start + 1} of {text!r}: each mixer (* + G) must be followed by its "
                                    f"MLP (- E); this version builds no layer of one without the other but M alone")
    return tuple(layers)


@functools.lru_cache(maxsize=64)
def parse_hybrid_layer_pattern(text: str) -> HybridPattern:
    """The pattern's layers by pipeline segment and its MTP depths; raises LayerPatternError saying what to write."""
    decoder, *depths = text.strip().split(DEPTH)
    segments = tuple(_layers(segment) for segment in decoder.split(STAGE))
    if not any(segments):
        raise LayerPatternError("the pattern has no decoder layer")
    if len(segments) > 1 and not all(segments):
        raise LayerPatternError("every pipeline segment between | needs a layer")
    parsed_depths = []
    for depth in depths:
        if STAGE in depth:
            raise LayerPatternError("| belongs to the decoder's part, before the first /")
        layers = _layers(depth)
        if not layers:
            raise LayerPatternError("every multi-token prediction depth after / needs a layer")
        parsed_depths.append(layers)
    if any(depth != parsed_depths[0] for depth in parsed_depths):
        raise LayerPatternError(f"the multi-token prediction depths are alike (Megatron repeats one depth's pattern); "
                                f"write {depths[0]!r} after each /")
    return HybridPattern(segments, tuple(parsed_depths))


def apply_hybrid_layer_pattern(config: Config, given: set[str]) -> list[str]:
    """Set the per-layer flags from --hybrid-layer-pattern (a no-op without it); one line per problem: the pattern
    unreadable, or a flag in `given` (those set on the command line or in --config) describing another network."""
    m, p = config.model, config.parallel
    if m.hybrid_layer_pattern is None:
        return []
    flag = f"--hybrid-layer-pattern {m.hybrid_layer_pattern!r}"
    try:
        pattern = parse_hybrid_layer_pattern(m.hybrid_layer_pattern)
    except LayerPatternError as error:
        return [f"{flag}: {error}"]
    layers = pattern.layers
    count = len(layers)
    problems = []
    if "num_layers" in given and m.num_layers not in (count, pattern.symbols):
        problems.append(f"--num-layers {m.num_layers} disagrees with {flag}, which has {count} layers "
                        f"({pattern.symbols} symbols); drop --num-layers")
    m.num_layers = count
    problems += _per_layer_problems(config, pattern, given, flag)
    if "mtp_num_layers" in given and m.mtp_num_layers != len(pattern.depths):
        problems.append(f"--mtp-num-layers {m.mtp_num_layers} disagrees with {flag}, which has "
                        f"{len(pattern.depths)} prediction depths (/); drop --mtp-num-layers")
    m.mtp_num_layers = len(pattern.depths) or None
    segments = len(pattern.segments)
    pp = p.pipeline_model_parallel_size
    if pp > 1 and segments > 1:
        virtual = segments // pp
        if segments % pp:
            problems.append(f"{flag} has {segments} pipeline segments (|); with --pipeline-model-parallel-size {pp} "
                            f"give {pp} x the virtual stages per rank")
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                     "num_layers_per_virtual_pipeline_stage"):
            if name in given:
                problems.append(f"--{name.replace('_', '-')} cannot be combined with {flag}: its | segments "
                                f"place the layers")
        given_virtual = p.num_virtual_stages_per_pipeline_rank or 1
        if "num_virtual_stages_per_pipeline_rank" in given and given_virtual != virtual and not segments % pp:
            problems.append(f"--num-virtual-stages-per-pipeline-rank {given_virtual} disagrees with {flag}: "
                            f"{segments} segments over {pp} stages are {virtual} per rank")
        p.num_virtual_stages_per_pipeline_rank = virtual if virtual > 1 else None
    return problems


def _per_layer_problems(config: Config, pattern: HybridPattern, given: set[str], flag: str) -> list[str]:
    """Set the MoE, Gated DeltaNet and multi-latent-attention flags from the pattern's layers."""
    m = config.model
    layers = pattern.layers
    moe, linear = [layer.mlp == "E" for layer in layers], [layer.mixer == "G" for layer in layers]
    every_layer = layers + [layer for depth in pattern.depths for layer in depth]
    mixers = {layer.mixer for layer in every_layer}
    any_moe = any(layer.mlp == "E" for layer in every_layer)
    problems = []
    if any_moe and not m.num_experts:
        problems.append(f"{flag} has MoE layers (E): give --num-experts")
    if not any_moe and m.num_experts:
        problems.append(f"--num-experts acts only in MoE layers and {flag} has none (E); drop --num-experts")
    for name, wanted, parse, active in (("moe_layer_freq", moe, parse_moe_layer_freq, any(moe)),
                                        ("linear_attention_freq", linear, parse_interleaved_freq, any(linear))):
        if name in given and active and _parsed_or_none(parse, getattr(m, name), len(layers)) != wanted:
            problems.append(f"--{name.replace('_', '-')} {getattr(m, name)!r} disagrees with {flag}; drop it")
        if active:
            setattr(m, name, layer_list_expression(wanted))
    if "experimental_attention_variant" in given and m.experimental_attention_variant != (
            "gated_delta_net" if any(linear) else None):
        problems.append(f"--experimental-attention-variant {m.experimental_attention_variant} disagrees with {flag} "
                        f"(G layers are Gated DeltaNet); drop it")
    m.experimental_attention_variant = "gated_delta_net" if any(linear) else None
    if {"*", "+"} <= mixers:
        problems.append(f"{flag} mixes softmax attention (*) and multi-latent attention (+); this version builds "
                        f"one kind of attention per model")
    elif "multi_latent_attention" in given and "*" in mixers:
        problems.append(f"--multi-latent-attention disagrees with {flag}, whose attention layers are *; write them "
                        f"as + or drop the flag")
    m.multi_latent_attention = "+" in mixers
    return problems


def _parsed_or_none(parse, value, num_layers: int) -> list[bool] | None:
    try:
        return parse(value, num_layers)
    except LayerPatternError:
        return None


def pattern_chunk_layers(config: Config) -> list[list[int]] | None:
    """Layers of each model chunk [virtual stage][pipeline stage] that the pattern's | segments give under pipeline
    parallelism; None where they place nothing (no pattern, no |, or one pipeline stage)."""
    m, p = config.model, config.parallel
    if m.hybrid_layer_pattern is None or p.pipeline_model_parallel_size == 1:
        return None
    segments = parse_hybrid_layer_pattern(m.hybrid_layer_pattern).segments
    pp = p.pipeline_model_parallel_size
    if len(segments) == 1 or len(segments) % pp:
        return None
    counts = [len(segment) for segment in segments]
    return [counts[start:start + pp] for start in range(0, len(counts), pp)]


def pattern_without_stages(text: str) -> str:
    """The pattern with its | removed: the same network, placed by whatever layout loads it."""
    return text.replace(STAGE, "")
