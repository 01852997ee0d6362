"""A conversation -> its tokens and which of them the model learns: the assistant's.

The text is the chat template's: the tokenizer's own `chat_template`, or a named prompt format
(--sft-tokenizer-prompt-format, prompt_formats.py), rendered and tokenized by transformers' `apply_chat_template`.
The assistant mask marks every token of every assistant turn, with the turn's end-of-turn token, and nothing of the
system, user and tool turns:

- a template with `{% generation %}` tags marks the assistant's text itself; the mask is transformers'
  (`return_assistant_tokens_mask=True`);
- a template without them (most published ones) gets the same mask from its own renderings: assistant turn i is
  the text that rendering the first i + 1 messages adds to rendering the first i with the generation prompt (the
  header that opens an assistant turn). Whitespace the template writes after a turn's end-of-turn token (a special
  token, such as ChatML's `<|im_end|>`) separates turns and is not learnt; without such a token, as in the
  Nemotron formats, the turn's closing newline is its end and is learnt. A token is marked when it overlaps an
  assistant span, as transformers marks it.

A template that renders a conversation otherwise than its prefixes (one that drops earlier reasoning, say) has no
exact mask this way: that conversation stops the run with one line asking for `{% generation %}` tags, never
an all-ones mask. Plain text (the `text` layout) is learnt whole and ends with the end-of-document token.
"""

from __future__ import annotations

import os
import re

import numpy as np

from megatron_lite.data.sft.prompt_formats import FORMAT_TOKENS, PROMPT_FORMATS
from megatron_lite.errors import DataError

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def load_hf_tokenizer(path: str):
    """transformers' fast tokenizer for a tokenizer.json (or the folder holding it and its tokenizer_config.json)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise DataError("--sft renders chat templates with transformers: pip install 'megatron-lite[hf]'") from None
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise DataError(f"--sft needs a Hugging Face tokenizer.json; {path} is not one or a folder holding one")
    return PreTrainedTokenizerFast.from_pretrained(folder)


class ChatTokenizer:
    """Tokens and assistant masks of conversations, by the chat template of `tokenizer_model` or `prompt_format`."""

    def __init__(self, tokenizer_model: str, prompt_format: str | None = None):
        self.tokenizer = load_hf_tokenizer(tokenizer_model)
        if prompt_format is not None:
            if prompt_format not in PROMPT_FORMATS:
                raise DataError(f"unknown --sft-tokenizer-prompt-format {prompt_format!r}; choose one of "
                                f"{', '.join(PROMPT_FORMATS)}, or leave it out to use the tokenizer's chat template")
            vocabulary = self.tokenizer.get_vocab()
            missing = [token for token in FORMAT_TOKENS[prompt_format] if token not in vocabulary]
            if missing:
                raise DataError(f"the {prompt_format} prompt format writes {', '.join(missing)}, which "
                                f"{tokenizer_model} does not hold as tokens; choose a format of its tokens")
            self.template = PROMPT_FORMATS[prompt_format]
        else:
            self.template = self.tokenizer.chat_template
            if not isinstance(self.template, str):
                raise DataError(f"{tokenizer_model} has no chat template (or several); add chat_template to its "
                                f"tokenizer_config.json, or name one with --sft-tokenizer-prompt-format "
                                f"({', '.join(PROMPT_FORMATS)})")
        self.tagged = bool(_GENERATION_TAG.search(self.template))
        self.end_of_turn_tokens = tuple(token.content for token in self.tokenizer.added_tokens_decoder.values()
                                        if token.special)
        self.eod = self.tokenizer.eos_token_id  # ends plain text; None: the tokenizer names no eos
        # what fills a sample after its conversations: never learnt nor attended to by them, so any id serves
        self.pad = next((i for i in (self.tokenizer.pad_token_id, self.eod) if i is not None), 0)

    def tokenize(self, conversation, where: str = "a conversation") -> tuple[np.ndarray, np.ndarray]:
        """(token ids int64, assistant mask bool) of one conversation (a message list, or plain text)."""
        if isinstance(conversation, str):
            ids = self.tokenizer(conversation, add_special_tokens=False)["input_ids"]
            if self.eod is not None:
                ids = ids + [self.eod]
            return np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=bool)
        if conversation[0]["role"] == "assistant":
            raise DataError(f"{where} opens with an assistant turn; begin it with a system or user turn")
        try:
            if self.tagged:
                out = self.tokenizer.apply_chat_template(conversation, chat_template=self.template, tokenize=True,
                                                         return_dict=True, return_assistant_tokens_mask=True)
                return (np.asarray(out["input_ids"], dtype=np.int64),
                        np.asarray(out["assistant_masks"], dtype=bool))
            return self._tokenize_by_prefixes(conversation, where)
        except DataError:
            raise
        except Exception as error:  # jinja2's TemplateError, or raise_exception() in the template
            raise DataError(f"the chat template fails on {where}: {type(error).__name__}: {error}") from None

    def prompt(self, messages: list[dict]) -> list[int]:
        """The ids that ask the model for the next assistant turn (generation)."""
        return list(self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=True,
                                                       return_dict=True, add_generation_prompt=True)["input_ids"])

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _tokenize_by_prefixes(self, conversation: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        text = self._render(conversation)
        spans = []
        for i, message in enumerate(conversation):
            if message["role"] != "assistant":
                continue
            opened, closed = self._render(conversation[:i], generation_prompt=True), self._render(conversation[:i + 1])
            if not (closed.startswith(opened) and text.startswith(closed)):
                raise DataError(f"the chat template renders {where} otherwise than its first {i + 1} turns, so its "
                                f"assistant tokens cannot be found exactly; add {{% generation %}} tags around the "
                                f"assistant's text in the template")
            turn = closed[len(opened):]
            kept = turn.rstrip()
            if kept != turn and not kept.endswith(self.end_of_turn_tokens):
                kept = turn
            spans.append((len(opened), len(opened) + len(kept)))
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return (np.asarray(encoding["input_ids"], dtype=np.int64),
                _overlapping(encoding["offset_mapping"], spans))


def _overlapping(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """Which tokens (character offsets [start, end)) overlap one of the ordered `spans`."""
    mask = np.zeros(len(offsets), dtype=bool)
    span = 0
    for token, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        mask[token] = end > spans[span][0]
    return mask
