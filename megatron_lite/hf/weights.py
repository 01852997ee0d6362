"""Hugging Face tensors <-> global megatron_lite tensors, driven by the family's name table (families/).

Both directions work on whole (global) tensors keyed by megatron_lite's global parameter names with the
unpadded vocabulary, which is what a checkpoint stores, so the result loads into any parallel layout.
Import joins each rule's HF tensors into ours, export splits ours into HF's, and the expected HF shapes
(`hf_shapes`) come from the same rules, so a file that does not match its configuration is reported before
anything is converted. RoPE needs no permutation: ours is HF's "rotate half" layout (model/attention/self_attention.py).

The rules come grouped into `units`, what a streamed conversion holds at once: each tensor before or after
the layers alone, each decoder layer, each multi-token prediction module. `stream_to_megatron` and
`stream_to_hf` convert a unit at a time, reading its tensors when it comes and yielding its result, so memory
stays at about a layer (or the vocabulary table) whatever the depth; `to_megatron` and `to_hf` are the same
conversions with everything in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from megatron_lite.config.layer_specs import LayerSpec, depth_layer_specs, layer_specs
from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import ConversionError
from megatron_lite.hf.families import FAMILIES
from megatron_lite.hf.name_tables import NameTable, Rule

# Buffers some HF checkpoints carry that are not weights.
_NOT_WEIGHTS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


def is_weight(hf_name: str) -> bool:
    return not hf_name.endswith(_NOT_WEIGHTS)


# A vision-language model's language model and vision tower (transformers 5's names)
_LANGUAGE_MODEL, _VISION_TOWER = "model.language_model.", "model.visual."


def normalize_hf_names(family: str, names) -> dict[str, str]:
    """{canonical name: name in the file}: GPT-2 files from the Hub omit save_pretrained's `transformer.`; a
    vision-language model's language model is read as the text model (`model.language_model.` -> `model.`) and
    its vision tower left out (`vision_tower_names` counts it)."""
    if family == "gpt2":
        return {name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}": name
                for name in names}
    return {name.replace(_LANGUAGE_MODEL, "model.", 1) if name.startswith(_LANGUAGE_MODEL) else name: name
            for name in names if not name.startswith(_VISION_TOWER)}


def vision_tower_names(names) -> list[str]:
    return [name for name in names if name.startswith(_VISION_TOWER)]


Unit = list[tuple[Rule, dict]]


def units(family: str, m: ModelConfig, layers: Callable = iter) -> Iterator[Unit]:
    """Every rule of the family's table with the values of its placeholders, in checkpoint order, in the units
    a streamed conversion takes at once: each rule before and after the layers alone (a vocabulary table is
    the biggest tensor of most models), each decoder layer, each multi-token prediction module. `layers`
    wraps the loop over layer indices (a progress bar)."""
    table = FAMILIES[family].name_table(m)
    specs = layer_specs(m)
    for rule in table.head:
        yield [(rule, {})]
    for layer in layers(range(m.num_layers)):
        yield _expand(table.layer(specs[layer]), _layer_values(table, layer), m)
    depth_specs = depth_layer_specs(m)
    if m.mtp_num_layers and len(depth_specs) > 1 and table.blocks is None:
        raise ConversionError(f"multi-token prediction depths of {len(depth_specs)} layers are not stored by this "
                              f"Hugging Face family (it stores one layer per depth)")
    for depth in range(m.mtp_num_layers or 0):
        yield _mtp_unit(table, m, depth, depth_specs)
    for rule in table.tail:
        yield [(rule, {})]


def _expand(rules: list[Rule], values: dict, m: ModelConfig) -> Unit:
    """Each rule with `values`, an expert rule once per routed expert."""
    return [(rule, {**values, "expert": expert}) for rule in rules
            for expert in (range(m.num_experts) if "{expert}" in rule.ours else (None,))]


def _layer_values(table: NameTable, layer: int) -> dict:
    return {"layer": layer, **(table.blocks(layer) if table.blocks else {})}


def _expanded(family: str, m: ModelConfig, layers: Callable = iter) -> Iterator[tuple[Rule, dict]]:
    """Every rule with the values of its placeholders, in checkpoint order (the units, one after another)."""
    for unit in units(family, m, layers):
        yield from unit


def _mtp_unit(table: NameTable, m: ModelConfig, depth: int, specs: list[LayerSpec]) -> Unit:
    """A multi-token prediction module's rules with their values: its own (with its first layer's placeholders),
    then each of its layers' (`table.mtp_layer`'s, else a decoder layer's rules of the same kind, under our module's
    names). Its layers are numbered after the decoder's, depth by depth (config/layer_specs.py)."""
    if table.mtp is None:
        raise ConversionError("this Hugging Face family stores no multi-token prediction modules: convert without "
                              "--mtp-num-layers")
    first = m.num_layers + depth * len(specs)
    unit = _expand(table.mtp, {**_layer_values(table, first), "depth": depth}, m)
    for i, spec in enumerate(specs):
        ours = "mtp.layers.{depth}." + ("transformer_layer." if len(specs) == 1 else f"transformer_layers.{i}.")
        rules = [dataclasses.replace(rule, ours=rule.ours.replace("decoder.layers.{layer}.", ours))
                 for rule in (table.mtp_layer or table.layer)(spec)]
        unit += _expand(rules, {**_layer_values(table, first + i), "depth": depth}, m)
    return unit


def holds_mtp_weights(hf_names, num_layers: int | None) -> bool:
    """Whether HF tensors hold multi-token prediction weights: layers stored after the decoder's `num_layers`
    (DeepSeek-V3 keeps its module as layer 61 of 61) or blocks under mtp. (Nemotron 3); transformers saves none."""
    for name in hf_names:
        parts = name.split(".")
        if parts[0] == "mtp" or (num_layers is not None and name.startswith("model.layers.") and parts[2].isdigit()
                                 and int(parts[2]) >= num_layers):
            return True
    return False


def without_mtp(values: dict) -> dict:
    """Model flags with the multi-token prediction depths left out: --mtp-num-layers, and the pattern's / depths."""
    pattern = values.get("hybrid_layer_pattern")
    return {**values, "mtp_num_layers": None,
            **({"hybrid_layer_pattern": pattern.split("/")[0]} if pattern else {})}


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


def stream_to_megatron(family: str, hf, m: ModelConfig, layers: Callable = iter) -> Iterator[dict[str, torch.Tensor]]:
    """HF weights (a mapping by canonical name, read on access) -> global megatron_lite tensors, one dict per
    unit. Each rule's HF tensors are read, joined and dropped before the next rule's, so making a unit holds
    its own tensors and one rule's sources, and nothing of the units before once the caller drops them.
    `layers` wraps the loop over layer indices (a progress bar)."""
    made: dict[str, tuple[Rule, list[str]]] = {}  # our name -> the rule and HF names that made it first
    for unit in units(family, m, layers):
        yield _join_unit(unit, hf, m, made)  # not bound to a name here: the caller's drop frees the unit


def _sources(rule: Rule, values: dict, theirs: list[str], hf, stacks: dict) -> list[torch.Tensor]:
    """The HF tensors a rule joins: whole, or this expert's slice of tensors holding every expert of the layer
    (Rule.stacked_experts), each such tensor read once for the unit (`stacks`)."""
    if not rule.stacked_experts:
        return [hf[name] for name in theirs]
    for name in theirs:
        if name not in stacks:
            stacks[name] = hf[name]
    return [stacks[name][values["expert"]] for name in theirs]


def _join_unit(unit: Unit, hf, m: ModelConfig, made: dict) -> dict[str, torch.Tensor]:
    out, stacks = {}, {}
    for rule, values in unit:
        ours, theirs = _names(rule, values)
        tensor = rule.transform.join(_sources(rule, values, theirs, hf, stacks), m)
        if ours in made:  # a module's copy of a table made before: checked against it, stored once
            first, first_theirs = made[ours]
            if not (tensor.is_meta or torch.equal(first.transform.join([hf[n] for n in first_theirs], m), tensor)):
                raise ConversionError(f"'{theirs[0]}' differs from the tensor it copies ({ours} in ours): the "
                                      f"multi-token prediction module shares the model's embedding and output layer")
            continue
        made[ours] = (rule, theirs)
        out[ours] = tensor
    return out


def to_megatron(family: str, hf, m: ModelConfig, layers: Callable = iter) -> dict[str, torch.Tensor]:
    """HF weights (a mapping by canonical name) -> global megatron_lite tensors, all at once. `layers` wraps the
    loop over layer indices (a progress bar)."""
    out = {}
    for part in stream_to_megatron(family, hf, m, layers):
        out.update(part)
    return out


def stream_to_hf(family: str, read: Callable[[list[str]], dict[str, torch.Tensor]], m: ModelConfig,
                 layers: Callable = iter) -> Iterator[dict[str, torch.Tensor]]:
    """Global megatron_lite tensors -> HF weights under save_pretrained's names (any vocabulary padding dropped),
    one dict per unit, in `to_hf`'s order. `read(names)` gives the named tensors of ours (a checkpoint reads
    them then); a unit's HF tensors are views of them where the split allows, and go with the unit."""
    for unit in units(family, m, layers):
        yield _split_unit(unit, read, m)  # not bound to a name here: the caller's drop frees the unit


def _split_unit(unit: Unit, read: Callable, m: ModelConfig) -> dict[str, torch.Tensor]:
    named = [(rule, *_names(rule, values)) for rule, values in unit]
    tensors = read(list(dict.fromkeys(ours for _, ours, _ in named)))
    out, stacks = {}, {}
    for rule, ours, theirs in named:
        _place(rule, theirs, rule.transform.split(tensors[ours], m), out, stacks)
    return {**out, **_stacked(stacks)}


def _place(rule: Rule, theirs: list[str], pieces: list[torch.Tensor], out: dict, stacks: dict) -> None:
    """Put a rule's HF pieces in `out`, or, for tensors holding every expert of a layer, after the previous
    experts' pieces in `stacks` (rules expand expert by expert, in order)."""
    if not rule.stacked_experts:
        out.update(zip(theirs, pieces, strict=True))
        return
    for name, piece in zip(theirs, pieces, strict=True):
        stacks.setdefault(name, []).append(piece)


def _stacked(stacks: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: torch.stack(pieces) for name, pieces in stacks.items()}


def to_hf(family: str, tensors: dict, m: ModelConfig, layers: Callable = iter) -> dict[str, torch.Tensor]:
    """Global megatron_lite tensors -> HF weights under save_pretrained's names (any vocabulary padding dropped),
    all at once; a multi-token prediction module's copies of a table are copies (save_file refuses tensors
    that share memory)."""
    out, stacks, exported = {}, {}, set()
    for rule, values in _expanded(family, m, layers):
        ours, theirs = _names(rule, values)
        pieces = rule.transform.split(tensors[ours], m)
        if ours in exported:  # a multi-token prediction module's copy of a table: stored on its own
            pieces = [piece.clone() for piece in pieces]
        exported.add(ours)
        _place(rule, theirs, pieces, out, stacks)
    return {**out, **_stacked(stacks)}
