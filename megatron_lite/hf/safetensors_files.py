"""Hugging Face model directories on disk: (sharded) safetensors weights, config.json, tokenizer files.

Reading is lazy and unmapped: a tensor is read from its file when asked for, into memory of its own that
is given back when the caller drops it (safetensors_format.py says why not safe_open's memory map), so a
conversion holds what it is converting and nothing of the tensors before. Writing follows
`save_pretrained`: one `model.safetensors`, or above `max_shard_bytes` numbered shards and a
`model.safetensors.index.json` that maps every tensor to its file; `ShardedWriter` plans the files from the
names, shapes and dtypes alone and takes the tensors one at a time, so no shard is ever held whole either.
Only local directories are read; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping

import torch
from safetensors import safe_open

from megatron_lite.files import is_a, read_json_object
from megatron_lite.hf.configs import ConversionError
from megatron_lite.hf.safetensors_format import Entry, StreamedFile, read_header, read_tensor

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Files a model directory may carry beside its weights: tokenizers (HF tokenizers, sentencepiece, GPT-2 BPE), the
# chat template as newer transformers saves it (beside tokenizer_config.json, which then holds none), and the
# generation defaults (bos/eos/pad ids).
CHAT_TEMPLATE_NAME = "chat_template.jinja"
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "added_tokens.json", CHAT_TEMPLATE_NAME, "generation_config.json")


def read_hf_config(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise ConversionError(f"{folder} is not a local directory (nothing is downloaded: fetch the model first, "
                              f"e.g. with `huggingface-cli download`)")
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.lexists(path):
        raise ConversionError(f"no {CONFIG_NAME} in {folder}")
    return read_json_object(path, ConversionError)


class HFWeights(Mapping):
    """The weights of a local HF model directory by name, read from disk on access (each access a new tensor).

    `names` maps the names callers use to the names in the files (GPT-2 files from the Hub omit the
    `transformer.` prefix that save_pretrained writes)."""

    def __init__(self, folder: str):
        index, single = os.path.join(folder, INDEX_NAME), os.path.join(folder, WEIGHTS_NAME)
        if os.path.lexists(index):
            self.file_of = {name: os.path.join(folder, file) for name, file in _weight_map(index).items()}
        elif os.path.lexists(single):
            with _open_safetensors(single) as f:
                self.file_of = dict.fromkeys(f.keys(), single)
        else:
            legacy = " (pytorch_model.bin is not read: re-save it with save_pretrained(safe_serialization=True))" \
                if os.path.isfile(os.path.join(folder, "pytorch_model.bin")) else ""
            raise ConversionError(f"no weights file in {folder}: expected {WEIGHTS_NAME} or {INDEX_NAME}{legacy}")
        for file in sorted(set(self.file_of.values())):
            if not os.path.isfile(file):
                raise ConversionError(f"weights file {file} listed in {INDEX_NAME} is missing")
        self.names = {name: name for name in self.file_of}
        self._headers: dict[str, dict[str, Entry]] = {}

    def _entry(self, stored: str) -> Entry:
        file = self.file_of[stored]
        if file not in self._headers:
            with _open_safetensors(file):  # safetensors' own check of the header; closed again at once
                pass
            self._headers[file] = read_header(file)
        if stored not in self._headers[file]:
            raise ConversionError(f"{INDEX_NAME} places '{stored}' in {file}, which does not hold it")
        return self._headers[file][stored]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self._entry(stored).shape for name, stored in self.names.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        stored = self.names[name]
        return read_tensor(self.file_of[stored], self._entry(stored))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _weight_map(index: str) -> dict[str, str]:
    """The "weight_map" of a model.safetensors.index.json: tensor name -> file name beside it."""
    weight_map = read_json_object(index, ConversionError).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise ConversionError(f"{index}: 'weight_map' should be an object mapping each tensor name to its file, "
                              f"is {json.dumps(weight_map)[:60]}")
    return weight_map


def _open_safetensors(file: str):
    """A safetensors file opened for reading, or a ConversionError naming it (unreadable, not safetensors)."""
    try:
        return safe_open(file, framework="pt")
    except OSError as error:
        raise ConversionError(f"cannot read weights file {file} ({error.strerror or error})") from None
    except Exception as error:  # safetensors raises its own SafetensorError for a damaged header
        raise ConversionError(f"weights file {file} is not a safetensors file ({error})") from None


def shard_plan(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Names in order, cut into files of at most `max_shard_bytes` (a bigger tensor gets a file of its own)."""
    shards, size = [[]], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """save_pretrained's file names for `count` shards (one file is plain model.safetensors)."""
    return [WEIGHTS_NAME] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


class ShardedWriter:
    """save_pretrained's files for tensors that come one at a time, in any order. `layout` names every tensor
    in order with its shape and dtype (meta tensors will do), so the shards (`shard_plan`) and their headers
    are fixed before the first tensor; each file is closed, and `on_file(name)` told, as soon as its last
    tensor is in. Use it as a context manager: leaving it writes the index, or on an error closes what is
    open."""

    def __init__(self, folder: str, layout: dict[str, torch.Tensor], max_shard_bytes: int,
                 on_file: Callable[[str], None] = lambda name: None):
        self.folder, self.layout, self.on_file = folder, layout, on_file
        shards = shard_plan(layout, max_shard_bytes)
        self.files = shard_names(len(shards))
        self.file_of = {name: file for file, shard in zip(self.files, shards) for name in shard}
        self._shards = dict(zip(self.files, shards))
        self._open: dict[str, StreamedFile] = {}
        self._done: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.file_of:
            raise ConversionError(f"'{name}' is not among the tensors planned for {self.folder}")
        file = self.file_of[name]
        if file in self._done:
            raise ConversionError(f"'{name}' was written to {file} twice")
        if file not in self._open:
            self._open[file] = StreamedFile(os.path.join(self.folder, file),
                                            {n: self.layout[n] for n in self._shards[file]}, {"format": "pt"})
        streamed = self._open[file]
        streamed.write(name, tensor)
        if streamed.complete:
            streamed.close()
            del self._open[file]
            self._done.add(file)
            self.on_file(file)

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        for streamed in self._open.values():
            streamed.close()
        if kind is None:
            self._finish()

    def _finish(self) -> None:
        missing = [file for file in self.files if file not in self._done]
        if missing:
            raise ConversionError(f"{os.path.join(self.folder, missing[0])} never received all of its tensors")
        if len(self.files) > 1:
            total = sum(t.numel() * t.element_size() for t in self.layout.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(self.file_of)}
            with open(os.path.join(self.folder, INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
            self.files = [*self.files, INDEX_NAME]


def write_hf_config(folder: str, config: dict) -> None:
    with open(os.path.join(folder, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def generation_token_ids(folder: str) -> dict:
    """bos/eos/pad token ids from a folder's generation_config.json ({} without one)."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.lexists(path):
        return {}
    generation = read_json_object(path, ConversionError)
    ids = {key: generation[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in generation}
    for key, value in ids.items():
        if not (value is None or is_a(value, int) or (isinstance(value, list) and all(is_a(v, int) for v in value))):
            raise ConversionError(f"{path}: '{key}' is {json.dumps(value)[:40]}; a token id is an integer (or a "
                                  f"list of them, or null)")
    return ids


def copy_carried_files(source: str, target: str) -> list[str]:
    """Copy the tokenizer and generation-config files of folder `source` that exist; returns their names."""
    copied = []
    for name in CARRIED_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path) and not os.path.exists(os.path.join(target, name)):
            shutil.copy2(path, os.path.join(target, name))
            copied.append(name)
    return copied


def write_chat_template(folder: str, template: str) -> None:
    """Make `template` the chat template of the tokenizer in `folder`, as transformers reads it: chat_template.jinja
    (which transformers reads before tokenizer_config.json) and tokenizer_config.json's chat_template (which older
    versions read)."""
    path = os.path.join(folder, "tokenizer_config.json")
    config = read_json_object(path, ConversionError) if os.path.lexists(path) else {}
    config["chat_template"] = template
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    with open(os.path.join(folder, CHAT_TEMPLATE_NAME), "w", encoding="utf-8") as f:
        f.write(template)
