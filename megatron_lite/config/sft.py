"""The data flags of supervised fine-tuning on conversations (data/sft/), with Megatron-LM's names where it has
them: a section of DataConfig kept in a file of its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SFTConfig:
    sft: bool = False
    """supervised fine-tuning: --data-path names conversations (JSON lines, Parquet, a saved datasets folder, or a
    prefix from tools/preprocess_data.py --sft), rendered by the chat template, one row a sample with its
    conversations packed; the loss is learnt on assistant tokens only and normalised per token"""
    sft_tokenizer_prompt_format: str | None = None
    """the chat template of --sft: chatml, nemotron-h-aligned or nemotron-nano-v2; default: the tokenizer's own
    chat_template"""
    sft_long_conversations: str = "truncate"
    """--sft: a conversation longer than the room left in its sample is truncated (Megatron's rule; the row's later
    conversations are left out) or dropped (the next one tried); the log counts them"""


def sft_problems(config) -> list[str]:
    """What --sft needs: a Hugging Face tokenizer (chat templates are transformers'), and no data source it does not
    read."""
    d = config.data
    if not d.sft:
        return []
    problems = []
    if d.tokenizer_type != "HuggingFaceTokenizer":
        problems.append(f"--sft renders conversations with a Hugging Face tokenizer's chat template: pass "
                        f"--tokenizer-type HuggingFaceTokenizer (not {d.tokenizer_type}) and its tokenizer.json folder")
    return problems
