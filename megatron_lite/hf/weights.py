"""Hugging Face tensors <-> global megatron_lite tensors, driven by the family's name table (name_tables.py).

Both directions work on whole (global) tensors keyed by megatron_lite's global parameter names with the
unpadded vocabulary, which is what a checkpoint stores, so the result loads into any parallel layout.
Import joins each rule's HF tensors into ours, export splits ours into HF's, and the expected HF shapes
(`hf_shapes`) come from the same rules, so a file that does not match its configuration is reported before
anything is converted. RoPE needs no permutation: ours is HF's "rotate half" layout (model/attention.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.hf.configs import ConversionError
from megatron_lite.hf.name_tables import NAME_TABLES, NameTable, Rule
from megatron_lite.model.layer_pattern import is_moe_layer, moe_layer_pattern

# Buffers some HF checkpoints carry that are not weights.
_NOT_WEIGHTS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def is_weight(hf_name: str) -> bool:
    return not hf_name.endswith(_NOT_WEIGHTS)


def normalize_hf_names(family: str, names) -> dict[str, str]:
    """{canonical name: name in the file}: GPT-2 files from the Hub omit save_pretrained's `transformer.`."""
    if family != "gpt2":
        return {name: name for name in names}
    return {name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}": name for name in names}


def _expanded(family: str, m: ModelConfig, layers: Callable = iter) -> Iterator[tuple[Rule, dict]]:
    """Every rule of the family's table with the values of its placeholders, in checkpoint order; `layers`
    wraps the loop over layer indices (a progress bar)."""
    table = NAME_TABLES[family](m)
    moe = moe_layer_pattern(m) if table.dense_layer is not None else [True] * m.num_layers
    for rule in table.head:
        yield rule, {}
    for layer in layers(range(m.num_layers)):
        for rule in table.layer if moe[layer] else table.dense_layer:
            experts = range(m.num_experts) if "{expert}" in rule.ours else (None,)
            for expert in experts:
                yield rule, {"layer": layer, "expert": expert}
    for depth in range(m.mtp_num_layers or 0):
        layer = m.num_layers + depth  # where the module is stored, and the global number of its layer
        for rule in _mtp_rules(table, is_moe_layer(m, layer) or table.dense_layer is None):
            experts = range(m.num_experts) if "{expert}" in rule.ours else (None,)
            for expert in experts:
                yield rule, {"layer": layer, "depth": depth, "expert": expert}
    for rule in table.tail:
        yield rule, {}


def _mtp_rules(table: NameTable, moe: bool) -> list[Rule]:
    """A multi-token prediction module's rules: its own, then its transformer layer's (a decoder layer's rules of
    the same kind, under our module's name)."""
    if table.mtp is None:
        raise ConversionError("this Hugging Face family stores no multi-token prediction modules: convert without "
                              "--mtp-num-layers")
    inner = [dataclasses.replace(rule, ours=rule.ours.replace("decoder.layers.{layer}.",
                                                              "mtp.layers.{depth}.transformer_layer."))
             for rule in (table.layer if moe else table.dense_layer)]
    return table.mtp + inner


def stored_mtp_modules(hf_names, num_layers: int) -> int:
    """How many multi-token prediction modules HF tensors hold: the layers stored after the decoder's
    `num_layers` (DeepSeek-V3 keeps its module as layer 61 of 61; transformers saves none)."""
    layers = {int(name.split(".")[2]) for name in hf_names
              if name.startswith("model.layers.") and name.split(".")[2].isdigit()}
    return len({layer for layer in layers if layer >= num_layers})


def _names(rule: Rule, values: dict) -> tuple[str, list[str]]:
    return rule.ours.format(**values), [name.format(**values) for name in rule.theirs]


def hf_shapes(family: str, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Hugging Face checkpoint of this configuration holds, with its shape."""
    shapes = {}
    for rule, values in _expanded(family, m):
        shapes.update(zip(_names(rule, values)[1], rule.shapes(m), strict=True))
    return shapes


def megatron_shapes(family: str, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The global tensors (unpadded vocabulary) a megatron_lite checkpoint of this configuration holds."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(family, m).items()}
    return {name: tuple(t.shape) for name, t in to_megatron(family, meta, m).items()}


def shape_problems(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> list[str]:
    """Missing tensors, tensors whose shape differs from the configuration's, and unexpected tensors."""
    problems = [f"{where} has no tensor '{name}'" for name in expected if name not in found]
    problems += [f"{where}: '{name}' has shape {tuple(found[name])} but the configuration implies {shape}"
                 for name, shape in expected.items() if name in found and tuple(found[name]) != shape]
    problems += [f"{where} holds '{name}', which this configuration has no place for"
                 for name in found if name not in expected]
    return problems


def to_megatron(family: str, hf, m: ModelConfig, layers: Callable = iter) -> dict[str, torch.Tensor]:
    """HF weights (a mapping by canonical name) -> global megatron_lite tensors. `layers` wraps the loop over
    layer indices (a progress bar)."""
    out = {}
    for rule, values in _expanded(family, m, layers):
        ours, theirs = _names(rule, values)
        tensor = rule.transform.join([hf[name] for name in theirs], m)
        if ours in out and not (tensor.is_meta or torch.equal(out[ours], tensor)):  # a module's copy of a table
            raise ConversionError(f"'{theirs[0]}' differs from the tensor it copies ({ours} in ours): the "
                                  f"multi-token prediction module shares the model's embedding and output layer")
        out[ours] = tensor
    return out


def to_hf(family: str, tensors: dict, m: ModelConfig, layers: Callable = iter) -> dict[str, torch.Tensor]:
    """Global megatron_lite tensors -> HF weights under save_pretrained's names (any vocabulary padding dropped)."""
    out, exported = {}, set()
    for rule, values in _expanded(family, m, layers):
        ours, theirs = _names(rule, values)
        pieces = rule.transform.split(tensors[ours], m)
        if ours in exported:  # a multi-token prediction module's copy of a table: stored on its own
            pieces = [piece.clone() for piece in pieces]
        exported.add(ours)
        out.update(zip(theirs, pieces, strict=True))
    return out
