"""Train/valid/test SFT datasets from --data-path (or --data-args-path) and --split, or a blend per split, as
pretraining builds them (data/builder.py): --split cuts each file's rows into three contiguous ranges, weights blend
the files by Megatron's greedy interleaving, and several files without weights weigh by their rows."""

from __future__ import annotations

import math

from megatron_lite.data.blended_dataset import BlendedDataset, build_blending_indices, normalize_weights
from megatron_lite.data.builder import (
    SPLIT_NAMES,
    check_token_ids,
    parse_data_path,
    parse_split,
    read_data_args,
    split_ranges,
)
from megatron_lite.data.index_cache import default_cache_dir
from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.sft.chat_tokenizer import ChatTokenizer
from megatron_lite.data.sft.conversations import is_chat_file
from megatron_lite.data.sft.sft_dataset import SFTDataset
from megatron_lite.data.sft.tokenized import (
    TokenizedConversations,
    is_tokenized_prefix,
    load_conversations,
    open_prefix,
)
from megatron_lite.errors import DataError


def build_sft_datasets(config, num_samples: tuple[int, int, int], log=print):
    """(train, valid, test) SFTDatasets (or blends of them) for --sft, None where a split gets no samples. `log`
    takes one line per file and split: rows, conversations, and what was left out, cut or dropped."""
    d, m = config.data, config.model
    chat = ChatTokenizer(d.tokenizer_model, d.sft_tokenizer_prompt_format)
    options = {"seq_length": m.seq_length, "pad": chat.pad, "cp_size": config.parallel.context_parallel_size,
               "long_conversations": d.sft_long_conversations}
    if d.train_data_path:
        blends = [(f"--{name}-data-path", getattr(d, f"{name}_data_path")) for name in SPLIT_NAMES]
        shares = None
    else:
        words = read_data_args(d.data_args_path) if d.data_args_path else d.data_path
        blends = [("--data-args-path" if d.data_args_path else "--data-path", words)] * 3
        shares = parse_split(d.split)
    opened: dict[str, TokenizedConversations] = {}
    results = []
    for i, (name, (flag, words)) in enumerate(zip(SPLIT_NAMES, blends)):
        if not words or num_samples[i] == 0 or (shares is not None and shares[i] == 0):
            results.append(None)
            continue
        paths, weights = parse_data_path(words, flag)
        for path in paths:
            if path not in opened:  # a file tokenized, or a prefix checked, once for every split
                opened[path] = _open(path, chat, config)
        sources = [opened[path] for path in paths]
        ranges = [split_ranges(len(s), shares)[i] if shares is not None else (0, len(s)) for s in sources]
        for source, rows in zip(sources, ranges):
            if rows[0] == rows[1]:
                raise DataError(f"the {name} split of {source.source} gets no rows of its {len(source)}, but "
                                f"{num_samples[i]} {name} samples are needed; raise its share in --split or set it "
                                f"to 0")
        results.append(_blend(sources, ranges, weights, num_samples[i], name, options, log))
    return tuple(results)


def _open(path: str, chat: ChatTokenizer, config) -> TokenizedConversations:
    d = config.data
    if is_tokenized_prefix(path):
        check_token_ids(IndexedDataset(path, d.mmap_bin_files), config.model.vocab_size,
                        d.data_cache_path or default_cache_dir(path))
        return open_prefix(path, d.mmap_bin_files)
    if not is_chat_file(path):
        raise DataError(f"--sft reads conversations (.jsonl, .json, .parquet, a datasets.save_to_disk folder) or a "
                        f"prefix made by tools/preprocess_data.py --sft; {path} is neither")
    return load_conversations(path, chat, d.data_cache_path or default_cache_dir(path))


def _blend(sources, ranges, weights, num_samples: int, name: str, options: dict, log):
    if len(sources) == 1:
        return _dataset(sources[0], ranges[0], num_samples, name, options, log)
    weights = normalize_weights(weights or [rows[1] - rows[0] for rows in ranges]).tolist()
    targets = [math.ceil(num_samples * w) for w in weights]
    components = [_dataset(s, r, t, name, options, log) for s, r, t in zip(sources, ranges, targets)]
    dataset_index, sample_index = build_blending_indices(weights, sum(targets))
    return BlendedDataset(components, dataset_index, sample_index)


def _dataset(source: TokenizedConversations, rows: tuple[int, int], num_samples: int, name: str, options: dict,
             log) -> SFTDataset:
    dataset = SFTDataset(source, rows, num_samples, **options)
    c, p = source.counts, dataset.counts
    left_out = (f"; {c.without_assistant:,} conversations without an assistant turn left out"
                if c.without_assistant else "")
    cut = "dropped" if options["long_conversations"] == "drop" else "truncated"
    log(f"sft {name}: {source.source}: rows {rows[0]:,}..{rows[1]:,} of {len(source):,} "
        f"({c.conversations:,} conversations in the file{left_out}); "
        f"{p.dropped if cut == 'dropped' else p.truncated:,} conversations longer than their sample's room "
        f"{cut} (--seq-length {options['seq_length']})")
    return dataset
