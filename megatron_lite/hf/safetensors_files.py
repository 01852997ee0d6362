"""Hugging Face model directories on disk: (sharded) safetensors weights, config.json, tokenizer files.

Reading is lazy: a tensor is read from its file when asked for, so converting holds the converted model
plus one source tensor rather than two whole models. Writing follows `save_pretrained`: one
`model.safetensors`, or above `max_shard_bytes` numbered shards and a `model.safetensors.index.json`
that maps every tensor to its file. Only local directories are read; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_lite.files import is_a, read_json_object
from megatron_lite.hf.configs import ConversionError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Files a model directory may carry beside its weights: tokenizers (HF tokenizers, sentencepiece, GPT-2 BPE)
# and the generation defaults (bos/eos/pad ids).
CARRIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json")


def read_hf_config(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise ConversionError(f"{folder} is not a local directory (nothing is downloaded: fetch the model first, "
                              f"e.g. with `huggingface-cli download`)")
    path = os.path.join(folder, CONFIG_NAME)
    if not os.path.lexists(path):
        raise ConversionError(f"no {CONFIG_NAME} in {folder}")
    return read_json_object(path, ConversionError)


class HFWeights(Mapping):
    """The weights of a local HF model directory by name, read from disk on access.

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
        self._handles = {}

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = _open_safetensors(file)
        return self._handles[file]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self._handle(self.file_of[stored]).get_slice(stored).get_shape())
                for name, stored in self.names.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        stored = self.names[name]
        return self._handle(self.file_of[stored]).get_tensor(stored)

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


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes (save_pretrained's max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ConversionError(f"cannot read size {text!r}; write e.g. 5GB, 500MB or a number of bytes")
    units = {"": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    return int(float(match.group(1)) * units[(match.group(2) or "").lower()])


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


def write_hf_weights(folder: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int,
                     progress=lambda jobs, total: jobs) -> list[str]:
    """Write `tensors` as save_pretrained does; returns the files written. `progress(iterable, total)` wraps
    the loop over finished files. Files are written by a few threads at once (safetensors releases the GIL
    while it writes: about 2x faster than one at a time for a 1.2B model here)."""
    shards = shard_plan(tensors, max_shard_bytes)
    names = [WEIGHTS_NAME] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                    for i in range(len(shards))]

    def write(file: str, shard: list[str]) -> None:
        save_file({name: tensors[name].contiguous() for name in shard}, os.path.join(folder, file),
                  metadata={"format": "pt"})

    with ThreadPoolExecutor(max_workers=min(4, len(shards))) as pool:
        jobs = [pool.submit(write, file, shard) for file, shard in zip(names, shards)]
        for job in progress(as_completed(jobs), len(jobs)):
            job.result()
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
        with open(os.path.join(folder, INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
        names.append(INDEX_NAME)
    return names


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
