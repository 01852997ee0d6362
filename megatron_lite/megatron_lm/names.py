"""Megatron-Core's checkpoint keys <-> megatron_lite's global names.

megatron_lite names its parameters as Megatron-Core does (`decoder.layers.3.self_attention.linear_qkv.weight`,
QKV fused per query group, SwiGLU's fc1 as [gate; up]), so a tensor maps to a tensor of the same layout,
and only three things differ:

  * stacking: a torch_dist checkpoint of a model whose layers are all alike stores each layer parameter
    once, with the layers on a leading axis (`decoder.layers.self_attention.linear_qkv.weight` [L, ...]);
    one mixing dense and MoE layers (a list or a number above 1 for --moe-layer-freq) stores a key per
    layer (`decoder.layers.3.self_attention...`), as Megatron-Core's TransformerBlock decides;
  * routed experts: SequentialMLP stacks a layer's experts on a leading axis
    (`mlp.experts.experts.linear_fc1.weight` [E, ...]); ours are `mlp.experts.{e}.linear_fc1.weight`;
  * fused norms: Transformer Engine's spec, and the local spec's checkpoint keys since Megatron-Core 0.8,
    keep the layer's norms inside the next linear (`self_attention.linear_qkv.layer_norm_weight` is our
    `input_layernorm.weight`, `mlp.linear_fc1.layer_norm_weight` our `pre_mlp_layernorm.weight`).

A `Source` names where one of our tensors lies in a Megatron checkpoint: a key and the index along its
stacked axes (layer, expert), so a reader can fetch just that slice.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FUSED_NORMS = {  # Megatron-Core's key (within a layer) -> ours
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
_OURS_FUSED = {ours: theirs for theirs, ours in _FUSED_NORMS.items()}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_OUR_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
_SEQUENTIAL_EXPERTS = "mlp.experts.experts."
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
EXTRA_STATE = "_extra_state"


@dataclass(frozen=True)
class Source:
    """Our tensor is `key[index]`: `index` runs along the key's leading (stacked) axes."""

    key: str
    index: tuple[int, ...] = ()


def is_extra_state(key: str) -> bool:
    """Transformer Engine's (or the local spec's empty) per-module extra state: no weights."""
    return EXTRA_STATE in key.split("/")[0].rsplit(".", 1)[-1]


def our_names(key: str, shape: tuple[int, ...]) -> dict[str, Source]:
    """Our global names held by Megatron checkpoint tensor `key` of global `shape`, each with its Source."""
    if key.startswith("decoder.layers.") and not _LAYER.match(key):  # stacked layers
        rest = key.removeprefix("decoder.layers.")
        found = {}
        for layer in range(shape[0]):
            for name, source in _within_layer(rest, shape[1:]).items():
                found[f"decoder.layers.{layer}.{name}"] = Source(key, (layer, *source.index))
        return found
    match = _LAYER.match(key)
    if match:
        layer, rest = match.groups()
        return {f"decoder.layers.{layer}.{name}": Source(key, source.index)
                for name, source in _within_layer(rest, shape).items()}
    return {key: Source(key)}


def _within_layer(rest: str, shape: tuple[int, ...]) -> dict[str, Source]:
    """Our names (within a layer) held by a layer tensor Megatron calls `rest`, with indices along its experts."""
    local = _LOCAL_EXPERT.match(rest)
    if local:  # the torch format's SequentialMLP without expert parallelism: local experts are all of them
        return {f"mlp.experts.{local.group(1)}.{local.group(2)}": Source("")}
    if rest.startswith(_SEQUENTIAL_EXPERTS):
        parameter = rest.removeprefix(_SEQUENTIAL_EXPERTS)
        return {f"mlp.experts.{expert}.{parameter}": Source("", (expert,)) for expert in range(shape[0])}
    return {_FUSED_NORMS.get(rest, rest): Source("")}


def megatron_layer_key(name: str) -> tuple[str, int | None]:
    """Megatron-Core's key, within a layer, of our name within a layer, and the expert index it is stacked at
    (None outside the routed experts)."""
    expert = _OUR_EXPERT.match(name)
    if expert:
        return _SEQUENTIAL_EXPERTS + expert.group(2), int(expert.group(1))
    return _OURS_FUSED.get(name, name), None


def split_layer_name(name: str) -> tuple[int, str] | None:
    """(layer, name within the layer) of one of our decoder-layer names; None outside the decoder layers."""
    match = _LAYER.match(name)
    return (int(match.group(1)), match.group(2)) if match else None
