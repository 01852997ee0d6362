"""Supervised fine-tuning on conversations (--sft): chat data -> tokens and assistant masks -> packed samples.

    conversations.py   rows of a JSON-lines, Parquet or saved-dataset file, in the layout its columns name
    prompt_formats.py  named chat templates (--sft-tokenizer-prompt-format)
    chat_tokenizer.py  a conversation -> token ids and its assistant mask, by the chat template
    tokenized.py       every conversation of a file tokenized: cached, or PREFIX(_assistant_mask).bin/.idx
    sft_dataset.py     SFTDataset: a row of conversations packed into one sample, as Megatron packs it
    builder.py         train/valid/test SFT datasets from --data-path and --split, blends
"""
