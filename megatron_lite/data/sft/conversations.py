"""Conversations from a chat data file: JSON lines, Parquet or a saved `datasets` folder, in any layout that
Megatron-LM's VarlenDataset detects from the columns.

    messages            [{"role": ..., "content": ...}, ...]              (OpenAI / Llama post-training)
    conversations       [{"from": "human" | "gpt" | ..., "value": ...}]   (ShareGPT)
    instruction/output  one of instruction|prompt|query|question, one of output|response|completion|answer, and
                        an optional input|context appended to the instruction                    (Alpaca, Dolly)
    text                plain text, trained on whole, as in pretraining

A row of messages may hold several conversations back to back: as in Megatron's SFTDataset, each system message
after the first turn starts a new one. Each row becomes a list of conversations, each a list of
{"role", "content"} messages (or, for plain text, the text itself), checked here so that a file with a mistake
stops before any compute with one line naming the row: unknown roles, content that is not text, a layout none of
the above. A conversation without an assistant turn has nothing to learn from; it is left out and counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from megatron_lite.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "model": "assistant", "chatgpt": "assistant", "system": "system", "tool": "tool",
                   "function": "tool", "observation": "tool"}
_INSTRUCTION_KEYS = ("instruction", "prompt", "query", "question")
_OUTPUT_KEYS = ("output", "response", "completion", "answer")
_EXTRA_INPUT_KEYS = ("input", "context")


def is_chat_file(path: str) -> bool:
    """Whether `path` names a conversations file SFT reads (else a preprocessed prefix)."""
    return os.path.isdir(path) or os.path.splitext(path)[1].lower() in (".jsonl", ".json", ".parquet")


@dataclass
class ReadCounts:
    """What reading a file left out, for the log."""

    rows: int = 0
    conversations: int = 0
    without_assistant: int = 0
    skipped_rows: int = 0


def read_rows(path: str) -> Iterator[tuple[int, dict]]:
    """(row number from 1, record) of a JSON-lines, Parquet or saved-dataset file, in file order."""
    if not os.path.exists(path):
        raise DataError(f"SFT data {path} not found; --data-path names a conversations file (.jsonl, .parquet, "
                        f"a datasets.save_to_disk folder) or a prefix made by tools/preprocess_data.py --sft")
    if os.path.isdir(path):
        yield from _read_saved(path)
    elif path.lower().endswith(".parquet"):
        yield from _read_parquet(path)
    else:
        yield from _read_json_lines(path)


def _read_json_lines(path: str) -> Iterator[tuple[int, dict]]:
    if os.path.getsize(path) == 0:
        raise DataError(f"SFT data {path} is empty; write one conversation per line")
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {number} is not JSON ({error.msg} at column {error.colno}); "
                                f"fix or remove the line") from None
            if not isinstance(record, dict):
                raise DataError(f"{path} line {number} is a JSON {type(record).__name__}, not an object; "
                                f"write one object per line")
            yield number, record


def _read_parquet(path: str) -> Iterator[tuple[int, dict]]:
    import pyarrow.parquet

    try:
        table = pyarrow.parquet.read_table(path)
    except Exception as error:  # pyarrow raises its own hierarchy for unreadable files
        raise DataError(f"{path} is not a readable Parquet file ({error})") from None
    yield from enumerate(table.to_pylist(), 1)


def _read_saved(path: str) -> Iterator[tuple[int, dict]]:
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{path} is not a datasets.save_to_disk folder ({error})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if "train" not in dataset:
            raise DataError(f"{path} holds splits {sorted(dataset)} but no 'train' split; save the one to train on")
        dataset = dataset["train"]
    yield from enumerate(dataset, 1)


def layout_of(columns, path: str) -> str:
    """The layout the columns name (messages, sharegpt, alpaca, text), in that order of preference."""
    columns = set(columns)
    if "messages" in columns:
        return "messages"
    if "conversations" in columns:
        return "sharegpt"
    if columns & set(_INSTRUCTION_KEYS) and columns & set(_OUTPUT_KEYS):
        return "alpaca"
    if "text" in columns:
        return "text"
    raise DataError(f"{path}: cannot tell the conversation layout from the columns {sorted(columns)}; SFT reads "
                    f"'messages' (role/content), 'conversations' (ShareGPT from/value), an instruction "
                    f"({'|'.join(_INSTRUCTION_KEYS)}) with an output ({'|'.join(_OUTPUT_KEYS)}), or 'text'")


def read_conversations(path: str, counts: ReadCounts) -> Iterator[tuple[str, list]]:
    """(where, conversations) for each row of `path`: its place for error lines, and its conversations (a list of
    message lists, or of one text); rows left without a conversation to learn from are skipped (and counted in
    `counts`)."""
    layout = None
    for number, record in read_rows(path):
        layout = layout or layout_of(record.keys(), path)
        where = f"{path} row {number}"
        counts.rows += 1
        if layout == "text":
            text = _text(record, "text", where)
            conversations = [text] if text else []
        else:
            conversations = []
            for conversation in _split_conversations(_messages(record, layout, where)):
                if any(message["role"] == "assistant" for message in conversation):
                    conversations.append(conversation)
                else:
                    counts.without_assistant += 1
        counts.conversations += len(conversations)
        if conversations:
            yield where, conversations
        else:
            counts.skipped_rows += 1
    if layout is None:
        raise DataError(f"SFT data {path} holds no rows; write one conversation per row")


def _messages(record: dict, layout: str, where: str) -> list[dict]:
    if layout == "alpaca":
        instruction, output = _first(record, _INSTRUCTION_KEYS, where), _first(record, _OUTPUT_KEYS, where)
        extra = _first(record, _EXTRA_INPUT_KEYS, where)
        return [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction},
                {"role": "assistant", "content": output}]
    key, role_key, content_key = (("messages", "role", "content") if layout == "messages"
                                  else ("conversations", "from", "value"))
    if key not in record:
        raise DataError(f"{where} has no '{key}' column, which the file's first row has; its columns are "
                        f"{sorted(record)}")
    turns = record[key]
    if not isinstance(turns, list):
        raise DataError(f"{where}: '{key}' is {type(turns).__name__}, not a list of turns")
    messages = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn:
            raise DataError(f"{where}: turn {k} of '{key}' is not an object with a '{role_key}'")
        role = turn[role_key]
        if layout == "sharegpt":
            role = _SHAREGPT_ROLES.get(str(role).lower(), role)
        if role not in ROLES:
            known = ROLES if layout == "messages" else sorted(_SHAREGPT_ROLES)
            raise DataError(f"{where}: turn {k} has the unknown role {role!r}; roles are {', '.join(known)}")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise DataError(f"{where}: turn {k} ({role}) has {type(content).__name__} content; SFT reads text "
                            f"content only (a string per turn)")
        messages.append({"role": role, "content": content})
    return messages


def _split_conversations(messages: list[dict]) -> list[list[dict]]:
    """Megatron's SFTDataset rule: a system message starts a new conversation."""
    conversations: list[list[dict]] = []
    for message in messages:
        if message["role"] == "system" or not conversations:
            conversations.append([])
        conversations[-1].append(message)
    return conversations


def _first(record: dict, keys: tuple[str, ...], where: str) -> str:
    for key in keys:
        value = record.get(key)
        if value not in (None, ""):
            return _text(record, key, where)
    return ""


def _text(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: '{key}' is {type(value).__name__}; SFT reads text (a string)")
    return value
