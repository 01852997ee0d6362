"""What every Hugging Face conversion shares: the one-line ConversionError, and the two ways a family's config.json
reader raises it (a key it needs is missing, or a variant our model cannot reproduce exactly, which is refused
rather than converted into a different network). The families themselves are in families/."""

from __future__ import annotations

from megatron_lite.errors import UserError


class ConversionError(UserError, ValueError):
    """A checkpoint cannot be converted as asked; the message is one line saying what is wrong."""


def required(hf: dict, key: str):
    if hf.get(key) is None:
        raise ConversionError(f"config.json has no '{key}' (model_type {hf.get('model_type')})")
    return hf[key]


def refuse(condition: bool, what: str) -> None:
    if condition:
        raise ConversionError(f"{what} is not supported by megatron_lite; this checkpoint cannot be converted exactly")
