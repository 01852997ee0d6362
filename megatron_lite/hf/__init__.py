"""Hugging Face interchange: config mapping, weight mapping, safetensors files and model-only checkpoints.

    configs.py            config.json <-> megatron_lite model flags (llama, qwen2, qwen3, gpt2, mixtral, qwen*_moe)
    name_tables.py        one name table per family: which HF tensors make each of ours, and the transform
    weights.py            HF tensors <-> global megatron_lite tensors, both directions read from the name table,
                          a layer (unit) at a time or all at once
    safetensors_format.py the safetensors format read and written a tensor at a time (no memory map)
    safetensors_files.py  model directories: (sharded) safetensors, the index, tokenizer files
    checkpoint.py         the megatron_lite side: an ordinary checkpoint holding model weights only
    checkpoint_parts.py   one DCP directory written by a save per layer
    sizes.py              --max-shard-size values (5GB), read without torch

tools/convert_checkpoint.py drives these; tools/generate.py loads what they write.
"""
