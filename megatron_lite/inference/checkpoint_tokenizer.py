"""The tokenizer a checkpoint was trained or converted with: what generation and evaluation read text with."""

from __future__ import annotations

import os

from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.errors import DataError


def tokenizer_source(path: str, config, tokenizer_type: str | None = None,
                     tokenizer_model: str | None = None) -> tuple[str, str | None] | None:
    """(--tokenizer-type, --tokenizer-model) of the tokenizer named here, else of the one carried in the checkpoint
    directory (a converted model's), else of the run's; None when there is none."""
    if tokenizer_type is not None:
        return tokenizer_type, tokenizer_model
    root = os.path.dirname(os.path.abspath(path))
    if os.path.isfile(os.path.join(root, "tokenizer.json")):
        return "HuggingFaceTokenizer", root
    if os.path.isfile(os.path.join(root, "tokenizer.model")):
        return "SentencePieceTokenizer", os.path.join(root, "tokenizer.model")
    data = config.data
    if data.tokenizer_type != "NullTokenizer" and data.tokenizer_model and os.path.exists(data.tokenizer_model):
        return data.tokenizer_type, data.tokenizer_model
    return None


def find_tokenizer(path: str, config, tokenizer_type: str | None = None, tokenizer_model: str | None = None):
    """The tokenizer of `tokenizer_source` built; None when there is none."""
    source = tokenizer_source(path, config, tokenizer_type, tokenizer_model)
    return None if source is None else build_tokenizer(*source, config.model.vocab_size)


def find_chat_tokenizer(path: str, config, tokenizer_type: str | None = None, tokenizer_model: str | None = None,
                        prompt_format: str | None = None):
    """The ChatTokenizer of `tokenizer_source` (a Hugging Face tokenizer), rendering with `prompt_format`, else the
    run's --sft-tokenizer-prompt-format (the template it was fine-tuned with), else the tokenizer's chat template."""
    from megatron_lite.data.sft.chat_tokenizer import ChatTokenizer

    source = tokenizer_source(path, config, tokenizer_type, tokenizer_model)
    if source is None or source[0] != "HuggingFaceTokenizer":
        raise DataError(f"a chat prompt is rendered by a Hugging Face tokenizer's chat template; this checkpoint's "
                        f"tokenizer is {source[0] if source else 'not known'}: pass --tokenizer-type "
                        f"HuggingFaceTokenizer and --tokenizer-model (a tokenizer.json folder with a chat template)")
    return ChatTokenizer(source[1], prompt_format or getattr(config.data, "sft_tokenizer_prompt_format", None))
