"""Tokenizers behind --tokenizer-type, with the interface Megatron's trainer and tools expect.

Each tokenizer has `vocab_size` (unpadded), `eod` (the end-of-document id appended between
documents), `pad` (an id or None), `tokenize(text) -> list[int]` and `detokenize(ids) -> str`.
The model's embedding is padded beyond vocab_size by `padded_vocab_size`, so that it splits
evenly across tensor-parallel ranks and lands on sizes matrix multiplies like.
"""

import json
import os

from megatron_lite.errors import DataError
from megatron_lite.files import read_bytes, read_json_object

# Names that mark the end of a document in common tokenizer.json files, tried in order when
# no tokenizer_config.json says which token is the eos.
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<eod>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


def _require_file(path: str | None, flag_hint: str) -> str:
    if path is None:
        raise DataError(f"{flag_hint} needs --tokenizer-model PATH")
    if not os.path.exists(path):
        raise DataError(f"tokenizer model {path} not found; check --tokenizer-model")
    return path


def _other_kind_hint(raw: bytes, tokenizer_type: str) -> str:
    """'; use --tokenizer-type X' when the file (its bytes `raw`) that failed to load looks like the other kind.

    A tokenizer.json is JSON text and a sentencepiece .model is a binary protobuf, so the first
    byte tells them apart well enough to say which flag the user meant.
    """
    looks_like_json = raw[:64].lstrip().startswith(b"{")
    if looks_like_json and tokenizer_type != "HuggingFaceTokenizer":
        return "; it looks like a Hugging Face tokenizer.json: use --tokenizer-type HuggingFaceTokenizer"
    if not looks_like_json and tokenizer_type != "SentencePieceTokenizer":
        return "; if it is a sentencepiece .model, use --tokenizer-type SentencePieceTokenizer"
    return ""


class SentencePieceTokenizer:
    """A sentencepiece model (e.g. from tools/train_tokenizer.py, or Llama-2's tokenizer.model).

    The end-of-document token is the model's eos (`</s>`), as in Megatron's
    GPTSentencePieceTokenizer; documents are encoded without bos.
    """

    def __init__(self, model_file: str | None):
        import sentencepiece

        path = _require_file(model_file, "SentencePieceTokenizer")
        raw = read_bytes(path, DataError, "tokenizer model")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=raw)
        except (RuntimeError, OSError) as error:
            raise DataError(f"{path} is not a sentencepiece model ({error})"
                            f"{_other_kind_hint(raw, 'SentencePieceTokenizer')}") from None
        self.vocab_size = self._sp.get_piece_size()
        if self._sp.eos_id() < 0:
            raise DataError(f"sentencepiece model {path} has no eos piece to end documents; "
                            f"train it with tools/train_tokenizer.py")
        self.eod = self._sp.eos_id()
        self.pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else None
        self.bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def detokenize(self, ids, skip_special_tokens: bool = False) -> str:
        return self._sp.decode([int(i) for i in ids])  # sentencepiece never writes its control pieces


class HuggingFaceTokenizer:
    """A local `tokenizer.json` (HF `tokenizers`), given as the file or the folder holding it.

    The eos comes from a `tokenizer_config.json` beside it when there is one (as transformers
    saves it), else from the common end-of-text names.
    """

    def __init__(self, path: str | None):
        from tokenizers import Tokenizer

        path = _require_file(path, "HuggingFaceTokenizer")
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.lexists(file):
            raise DataError(f"{file} not found; --tokenizer-model takes a tokenizer.json "
                            f"or a folder holding one")
        raw = read_bytes(file, DataError, "tokenizer")
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8", errors="replace"))
        except Exception as error:  # the tokenizers library raises plain Exception for any unreadable file
            raise DataError(f"{file} is not a Hugging Face tokenizer.json ({error})"
                            f"{_other_kind_hint(raw, 'HuggingFaceTokenizer')}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_tokenizer_config(folder)
        eod = self._token_id(config.get("eos_token"), _EOD_CANDIDATES)
        if eod is None:
            raise DataError(f"{file} has none of the end-of-document tokens {list(_EOD_CANDIDATES)}; "
                            f"add one, or name it as eos_token in tokenizer_config.json")
        self.eod = eod
        self.pad = self._token_id(config.get("pad_token"), _PAD_CANDIDATES)
        self.bos = self._token_id(config.get("bos_token"), ())  # the one tokenizer_config.json names, if any

    def _token_id(self, configured, candidates) -> int | None:
        if isinstance(configured, dict):
            configured = configured.get("content")
        for name in ([configured] if configured else []) + list(candidates):
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _read_tokenizer_config(folder: str) -> dict:
    """tokenizer_config.json beside a tokenizer.json ({} without one), checked where its special tokens are named:
    each a token's text, an object with its "content" (as transformers saves an AddedToken), or null."""
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.lexists(path):
        return {}
    config = read_json_object(path, DataError)
    for key in ("eos_token", "pad_token"):
        value = config.get(key)
        text = value.get("content") if isinstance(value, dict) else value
        if value is not None and not isinstance(text, str):
            raise DataError(f"{path}: '{key}' is {json.dumps(value)[:60]}; give the token's text, or an object "
                            f"with its text as \"content\"")
    return config


class NullTokenizer:
    """Pre-tokenized text ("12 7 301") or mock data: ids are the numbers themselves.

    The id space is exactly vocab_size and its last id is the end-of-document token.
    """

    def __init__(self, vocab_size: int | None):
        if vocab_size is None or vocab_size < 2:
            raise DataError(f"NullTokenizer needs --vocab-size of at least 2 (got {vocab_size})")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1
        self.pad = None
        self.bos = None

    def tokenize(self, text: str) -> list[int]:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            raise DataError(f"NullTokenizer reads space-separated token ids, got {text[:40]!r}; "
                            f"use a real --tokenizer-type for raw text") from None

    def detokenize(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


TOKENIZER_TYPES = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "HuggingFaceTokenizer": HuggingFaceTokenizer,
    "NullTokenizer": NullTokenizer,
}


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None = None):
    """The tokenizer named by --tokenizer-type, loaded from --tokenizer-model (or --vocab-size)."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    return TOKENIZER_TYPES[tokenizer_type](tokenizer_model)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tensor_model_parallel_size: int) -> int:
    """vocab_size rounded up to a multiple of make_vocab_size_divisible_by x tensor-parallel size.

    Every TP rank then holds an equal slice of the embedding, and each slice is a multiple of
    make_vocab_size_divisible_by (128 by default) rows, which keeps the logits GEMM efficient.
    """
    if make_vocab_size_divisible_by < 1 or tensor_model_parallel_size < 1:
        raise ValueError(f"make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) and "
                         f"tensor-model-parallel-size ({tensor_model_parallel_size}) must be >= 1")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple
