"""Hugging Face interchange: config mapping, weight mapping, safetensors files and model-only checkpoints.

    families/             one module per Hugging Face family (model_type): its config.json <-> megatron_lite
                          model flags, the network it recognises and its name table; the registry in __init__.py
    configs.py            the ConversionError every part raises, and a family's two ways to raise it
    config_bounds.py      the types and ranges of config.json's keys, checked before any becomes a flag
    llama_config.py       what the config.json of every Llama-derived family shares (sizes, norms, RoPE, YaRN)
    name_tables.py        what the families' name tables share: rules, transforms, Llama's attention and names
    weights.py            HF tensors <-> global megatron_lite tensors, both directions read from the name table,
                          a layer (unit) at a time or all at once
    safetensors_format.py the safetensors format read and written a tensor at a time (no memory map)
    safetensors_files.py  model directories: (sharded) safetensors, the index, tokenizer files
    checkpoint.py         the megatron_lite side: an ordinary checkpoint holding model weights only
    checkpoint_parts.py   one DCP directory written by a save per layer
    sizes.py              --max-shard-size values (5GB), read without torch

tools/convert_checkpoint.py drives these; tools/generate.py loads what they write.
"""
