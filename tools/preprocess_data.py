"""Tokenize a raw-text corpus into Megatron-LM's .bin/.idx format (OUT_text_document.bin/.idx), or with --sft a
conversations file into its tokens and assistant masks (OUT_sft.bin/.idx and OUT_sft_assistant_mask.bin/.idx).

    python tools/preprocess_data.py --input data/shakespeare.jsonl --json-keys text \\
        --output-prefix data/shakespeare --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/tokenizer.model --append-eod --workers 2
    python tools/preprocess_data.py --sft --input examples/sft/tiny_chat.jsonl --output-prefix data/tiny_chat \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model data/chat_tokenizer
    pretrain_gpt.py --sft --data-path data/tiny_chat_sft ...   (the same samples as --data-path the .jsonl)

--sft reads one conversations file (JSON lines, Parquet or a datasets.save_to_disk folder, in the messages,
ShareGPT, instruction/output or text layout) and renders each conversation with the tokenizer's chat template,
or --sft-tokenizer-prompt-format's; a conversation is a sequence and a row a document of the indexed datasets.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.preprocess import preprocess  # noqa: E402
from megatron_lite.data.sft.prompt_formats import PROMPT_FORMATS  # noqa: E402
from megatron_lite.data.tokenizers import TOKENIZER_TYPES  # noqa: E402
from megatron_lite.errors import UserError  # noqa: E402
from megatron_lite.tool_args import ToolParser, output_prefix, positive_int  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(prog="preprocess_data.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="jsonl, json, parquet, arrow or txt files, folders of them, or a "
                             "datasets.save_to_disk folder (a .txt file is one document)")
    parser.add_argument("--json-keys", nargs="+",
                        help="columns to tokenize; each becomes OUT_KEY_document (default: text)")
    parser.add_argument("--output-prefix", required=True, type=output_prefix,
                        help="where to write OUT_KEY_document.bin/.idx")
    parser.add_argument("--tokenizer-type", required=True, choices=sorted(TOKENIZER_TYPES))
    parser.add_argument("--tokenizer-model", help="sentencepiece .model, or tokenizer.json (or its folder)")
    parser.add_argument("--vocab-size", type=positive_int, help="vocab size for NullTokenizer")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--workers", type=positive_int, help="tokenizer processes (default: 1)")
    parser.add_argument("--dtype", choices=["uint8", "uint16", "int32", "int64"],
                        help="token dtype in the .bin (default: the smallest that holds the vocab)")
    parser.add_argument("--cache-dir", help="datasets cache for the parsed input (default: HF's)")
    sft = parser.add_argument_group("supervised fine-tuning (as pretrain_gpt.py --sft reads)")
    sft.add_argument("--sft", action="store_true",
                     help="tokenize conversations with their assistant masks into OUT_sft.bin/.idx and "
                          "OUT_sft_assistant_mask.bin/.idx (one --input, --tokenizer-type HuggingFaceTokenizer)")
    sft.add_argument("--sft-tokenizer-prompt-format", choices=list(PROMPT_FORMATS),
                     help="the chat template to render with (default: the tokenizer's own chat_template)")
    args = parser.parse_args(argv)
    problem = _sft_problem(args)
    if problem:
        parser.error(problem)
    if not args.sft:
        args.json_keys, args.workers = args.json_keys or ["text"], args.workers or 1
    return args


def _sft_problem(args: argparse.Namespace) -> str | None:
    """What --sft (or its absence) cannot run with, as one line."""
    if not args.sft:
        return "--sft-tokenizer-prompt-format acts only with --sft" if args.sft_tokenizer_prompt_format else None
    if args.tokenizer_type != "HuggingFaceTokenizer":
        return (f"--sft renders conversations with a Hugging Face tokenizer's chat template: pass --tokenizer-type "
                f"HuggingFaceTokenizer (not {args.tokenizer_type}) and its tokenizer.json folder")
    if args.tokenizer_model is None:
        return "--sft needs --tokenizer-model: the folder of a tokenizer.json with a chat template"
    if len(args.input) != 1:
        return f"--sft reads one conversations file, got {len(args.input)} inputs; blend several with --data-path"
    given = [f"--{name.replace('_', '-')}" for name in ("json_keys", "append_eod", "workers", "dtype", "vocab_size",
                                                        "cache_dir") if getattr(args, name) not in (None, False)]
    if given:
        return (f"{', '.join(given)} does not apply to --sft (it writes each conversation's tokens and assistant "
                f"mask); drop it")
    return None


def preprocess_sft(args: argparse.Namespace) -> None:
    """Tokenize the conversations of --input once and write OUT_sft(_assistant_mask).bin/.idx; print the counts."""
    from tqdm import tqdm

    from megatron_lite.data.sft.chat_tokenizer import ChatTokenizer
    from megatron_lite.data.sft.tokenized import MASK_SUFFIX, tokenize_file, write_prefix

    if not os.path.exists(args.input[0]):
        raise FileNotFoundError(f"input {args.input[0]} not found; check --input")
    chat = ChatTokenizer(args.tokenizer_model, args.sft_tokenizer_prompt_format)
    prefix = args.output_prefix + "_sft"
    with tqdm(desc="tokenizing conversations", unit="conv", file=sys.stderr) as bar:
        arrays, counts = tokenize_file(args.input[0], _Counting(chat, bar))
    write_prefix(arrays, prefix, len(chat.tokenizer))
    learnt = int(arrays["assistant_mask"].sum())
    print(f"wrote {prefix}.bin/.idx and {prefix}{MASK_SUFFIX}.bin/.idx: {counts.rows:,} rows, "
          f"{counts.conversations:,} conversations, {len(arrays['tokens']):,} tokens ({learnt:,} assistant tokens "
          f"learnt); left out: {counts.without_assistant:,} conversations without an assistant turn, "
          f"{counts.skipped_rows:,} rows without a conversation")


class _Counting:
    """A ChatTokenizer that advances a progress bar per conversation."""

    def __init__(self, chat, bar):
        self.chat, self.bar = chat, bar

    def tokenize(self, conversation, where: str):
        self.bar.update()
        return self.chat.tokenize(conversation, where)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        if args.sft:
            preprocess_sft(args)
            return
        stats = preprocess(args.input, args.output_prefix, args.json_keys, args.tokenizer_type,
                           args.tokenizer_model, args.vocab_size, append_eod=args.append_eod,
                           workers=args.workers, dtype=args.dtype, cache_dir=args.cache_dir)
    except (ValueError, FileNotFoundError, UserError) as error:  # the library's one-line messages
        sys.exit(f"preprocess_data.py: error: {error}")
    except OSError as error:  # an input that cannot be read, an output prefix that cannot be written
        sys.exit(f"preprocess_data.py: error: {error.filename or 'a file'}: {error.strerror or error}")
    for s in stats.values():
        print(f"wrote {s.prefix}.bin/.idx: {s.documents} documents, {s.tokens} tokens, "
              f"{s.empty_documents} empty documents skipped")


if __name__ == "__main__":
    main()
