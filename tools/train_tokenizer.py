"""Train a BPE tokenizer on a corpus: sentencepiece's (byte fallback, eos = end of document), or with
--tokenizer-type HuggingFaceTokenizer a byte-level tokenizer.json folder, with a chat template for --sft.

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --vocab-size 4000 \\
        --model-prefix data/tokenizer
writes data/tokenizer.model (for --tokenizer-type SentencePieceTokenizer) and data/tokenizer.vocab.

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --vocab-size 4000 \\
        --tokenizer-type HuggingFaceTokenizer --chat-template chatml --model-prefix data/chat_tokenizer
writes the folder data/chat_tokenizer (for --tokenizer-type HuggingFaceTokenizer --tokenizer-model
data/chat_tokenizer): tokenizer.json with the special tokens <|endoftext|> (pad) and ChatML's <|im_start|> and
<|im_end|>, and tokenizer_config.json with the ChatML chat template and <|im_end|>, the end of a turn, as eos.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.tokenizer_training import CHAT_TEMPLATE_EOS, train_hf_bpe, train_sentencepiece  # noqa: E402
from megatron_lite.errors import UserError  # noqa: E402
from megatron_lite.tool_args import ToolParser, non_negative_int, output_prefix, positive_int  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(prog="train_tokenizer.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="jsonl, json, parquet, arrow or txt files, folders of them, or a "
                             "datasets.save_to_disk folder")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="text columns (default: text)")
    parser.add_argument("--vocab-size", type=positive_int, required=True, help="size of the trained vocabulary")
    parser.add_argument("--model-prefix", required=True, type=output_prefix,
                        help="writes PREFIX.model and PREFIX.vocab; with HuggingFaceTokenizer the folder PREFIX")
    parser.add_argument("--tokenizer-type", choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"],
                        default="SentencePieceTokenizer", help="the kind to train (default: SentencePieceTokenizer)")
    parser.add_argument("--chat-template", choices=sorted(CHAT_TEMPLATE_EOS),
                        help="with HuggingFaceTokenizer: the chat template for --sft, its special tokens and its "
                             "end of turn as eos")
    parser.add_argument("--special-tokens", nargs="*", default=[],
                        help="extra tokens kept whole, e.g. '<|im_start|>' (ids 4, 5, ...)")
    parser.add_argument("--input-sentence-size", type=non_negative_int, default=10_000_000,
                        help="lines sampled for training; 0 uses all (default: 10M; sentencepiece only)")
    parser.add_argument("--cache-dir", help="datasets cache for the parsed input (default: HF's)")
    args = parser.parse_args(argv)
    if args.chat_template and args.tokenizer_type != "HuggingFaceTokenizer":
        parser.error("--chat-template writes a Hugging Face tokenizer: add --tokenizer-type HuggingFaceTokenizer")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        if args.tokenizer_type == "HuggingFaceTokenizer":
            path = train_hf_bpe(args.input, args.model_prefix, args.vocab_size, args.json_keys, args.special_tokens,
                                args.chat_template, cache_dir=args.cache_dir)
        else:
            path = train_sentencepiece(args.input, args.model_prefix, args.vocab_size, args.json_keys,
                                       args.special_tokens, args.input_sentence_size, cache_dir=args.cache_dir)
    except (ValueError, FileNotFoundError, UserError) as error:  # the library's one-line messages
        sys.exit(f"train_tokenizer.py: error: {error}")
    except OSError as error:  # an input that cannot be read, a model prefix that cannot be written
        sys.exit(f"train_tokenizer.py: error: {error.filename or 'a file'}: {error.strerror or error}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
