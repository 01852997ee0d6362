"""A Hugging Face family as the rest of the package sees it: one model_type, its config.json read and written, the
network it recognises and its name table, as one value that the registry (families/__init__.py) lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import ConversionError
from megatron_lite.hf.name_tables import NameTable


class Family(NamedTuple):
    """One model_type. `values`: config.json -> the values of pretrain_gpt.py's model flags (ModelConfig field
    names), refusing with one line what our model cannot reproduce exactly. `config`: a ModelConfig -> the
    config.json that `transformers.AutoModelForCausalLM.from_pretrained` reads. `recognises`: whether a ModelConfig
    is exactly this family's network, or a ConversionError (`refuse_network`) where it has a feature that only this
    family has but not the rest of its network, so that no family after it is asked. `name_table`: which HF
    tensors make each global megatron_lite tensor. `detected`: False where another family has the same network
    (Qwen3.5's is Qwen3-Next's), so that this one is chosen only for a checkpoint converted from it.
    `language_model_of`: the model_type of a vision-language wrapper whose `text_config` is this family's."""

    model_type: str
    values: Callable[[dict], dict]
    config: Callable[[ModelConfig], dict]
    recognises: Callable[[ModelConfig], bool]
    name_table: Callable[[ModelConfig], NameTable]
    detected: bool = True
    language_model_of: str | None = None


def refuse_network(model_type: str, feature: str, needs: list[tuple[bool, str]]) -> None:
    """A ConversionError where a network has `feature`, which of the families only `model_type` has, but not the
    rest of its network: then no family has it, and the line says what it lacks. `needs` pairs each condition with
    its words."""
    missing = [what for ok, what in needs if not ok]
    if missing:
        raise ConversionError(f"no Hugging Face model type has this network: {model_type} (the one with {feature}) "
                              f"needs {', '.join(missing)}")
