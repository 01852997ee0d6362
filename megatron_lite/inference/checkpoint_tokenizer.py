"""The tokenizer a checkpoint was trained or converted with: what generation and evaluation read text with."""

from __future__ import annotations

import os

from megatron_lite.data.tokenizers import build_tokenizer


def find_tokenizer(path: str, config, tokenizer_type: str | None = None, tokenizer_model: str | None = None):
    """The tokenizer named here, else the one carried in the checkpoint directory (a converted model's), else
    the run's --tokenizer-model; None when there is none."""
    if tokenizer_type is not None:
        return build_tokenizer(tokenizer_type, tokenizer_model, config.model.vocab_size)
    root = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(root, "tokenizer.json")):
        return build_tokenizer("HuggingFaceTokenizer", root)
    if os.path.isfile(os.path.join(root, "tokenizer.model")):
        return build_tokenizer("SentencePieceTokenizer", os.path.join(root, "tokenizer.model"))
    data = config.data
    if data.tokenizer_type != "NullTokenizer" and data.tokenizer_model and os.path.exists(data.tokenizer_model):
        return build_tokenizer(data.tokenizer_type, data.tokenizer_model)
    return None
