"""Trains a BPE tokenizer on a corpus: sentencepiece's (--tokenizer-type SentencePieceTokenizer), or a Hugging Face
tokenizer.json folder (HuggingFaceTokenizer), which can carry a chat template for supervised fine-tuning (--sft).

The settings make a lossless, LLM-style tokenizer: byte fallback (no unknown tokens, any UTF-8
round-trips), no text normalisation, digits split one per token, and fixed ids for the
special tokens (sentencepiece: unk 0, bos 1, eos 2 = end of document, pad 3; Hugging Face: <|endoftext|> 0, then
the chat template's), then the user's own.
"""

import json
import os

from tqdm import tqdm

from megatron_lite.data.corpus import load_corpus

_RESERVED_IDS = 4  # unk, bos, eos, pad
_BYTE_PIECES = 256


def _lines(corpus, keys: list[str], progress: bool):
    """Every non-empty line of every document; sentencepiece trains on lines."""
    with tqdm(total=len(corpus), unit="doc", disable=not progress, desc="reading") as bar:
        for batch in corpus.batches(keys, batch_size=256):
            for key in keys:
                for text in batch[key]:
                    for line in (text or "").splitlines():
                        if line.strip():
                            yield line
            bar.update(len(batch[keys[0]]))


def train_sentencepiece(inputs: list[str], model_prefix: str, vocab_size: int, json_keys: list[str],
                        special_tokens: list[str] = (), input_sentence_size: int = 10_000_000,
                        cache_dir: str | None = None, progress: bool = True) -> str:
    """Train on `inputs` and write MODEL_PREFIX.model/.vocab; returns the .model path."""
    import sentencepiece

    minimum = _RESERVED_IDS + _BYTE_PIECES + len(special_tokens) + 1
    if vocab_size < minimum:
        raise ValueError(f"--vocab-size {vocab_size} is too small for byte fallback: it needs at least "
                         f"{minimum} (256 bytes + {_RESERVED_IDS + len(special_tokens)} special tokens + 1)")
    corpus = load_corpus(inputs, json_keys, cache_dir=cache_dir)
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_lines(corpus, json_keys, progress),
            model_prefix=model_prefix,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9995,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            user_defined_symbols=list(special_tokens),
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=min(os.cpu_count() or 1, 16),
            minloglevel=1,
        )
    except RuntimeError as error:
        message = str(error).strip().splitlines()[-1]
        raise ValueError(f"sentencepiece could not train: {message}") from None
    return model_prefix + ".model"


END_OF_TEXT = "<|endoftext|>"
# The chat templates a trained tokenizer can carry (prompt_formats.py, whose FORMAT_TOKENS it holds whole), each with
# its end-of-turn token: the eos that generation stops at (tools/generate.py --chat).
CHAT_TEMPLATE_EOS = {"chatml": "<|im_end|>"}


def train_hf_bpe(inputs: list[str], folder: str, vocab_size: int, json_keys: list[str],
                 special_tokens: list[str] = (), chat_template: str | None = None, cache_dir: str | None = None,
                 progress: bool = True) -> str:
    """Train a byte-level BPE tokenizer.json on `inputs` into `folder`, beside a tokenizer_config.json naming its eos
    (the end-of-turn token of `chat_template`, else <|endoftext|>), its pad (<|endoftext|>) and `chat_template` (a
    name of prompt_formats.PROMPT_FORMATS); returns the folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_lite.data.sft.prompt_formats import FORMAT_TOKENS, PROMPT_FORMATS

    chat_tokens, eos = (FORMAT_TOKENS[chat_template], CHAT_TEMPLATE_EOS[chat_template]) if chat_template \
        else ((), END_OF_TEXT)
    specials = list(dict.fromkeys([END_OF_TEXT, *chat_tokens, *special_tokens]))
    minimum = _BYTE_PIECES + len(specials) + 1
    if vocab_size < minimum:
        raise ValueError(f"--vocab-size {vocab_size} is too small for byte-level BPE: it needs at least {minimum} "
                         f"(256 bytes + {len(specials)} special tokens + 1)")
    corpus = load_corpus(inputs, json_keys, cache_dir=cache_dir)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_lines(corpus, json_keys, progress), trainer)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": END_OF_TEXT,
              "clean_up_tokenization_spaces": False}
    if chat_template:
        config["chat_template"] = PROMPT_FORMATS[chat_template]
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    return folder
