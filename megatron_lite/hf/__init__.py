"""Hugging Face interchange: config mapping, weight mapping, safetensors files and model-only checkpoints.

    configs.py           config.json <-> megatron_lite model flags (llama, qwen2, qwen3, gpt2, mixtral, qwen*_moe)
    name_tables.py       one name table per family: which HF tensors make each of ours, and the transform
    weights.py           HF tensors <-> global megatron_lite tensors, both directions read from the name table
    safetensors_files.py reading and writing (sharded) safetensors and carrying tokenizer files
    checkpoint.py        the megatron_lite side: an ordinary checkpoint holding model weights only

tools/convert_checkpoint.py drives these; tools/generate.py loads what they write.
"""
