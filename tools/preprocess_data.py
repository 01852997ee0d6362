"""Tokenize a raw-text corpus into Megatron-LM's .bin/.idx format (OUT_text_document.bin/.idx).

    python tools/preprocess_data.py --input data/shakespeare.jsonl --json-keys text \\
        --output-prefix data/shakespeare --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/tokenizer.model --append-eod --workers 2
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_lite.data.preprocess import preprocess  # noqa: E402
from megatron_lite.data.tokenizers import TOKENIZER_TYPES  # noqa: E402
from megatron_lite.errors import UserError  # noqa: E402
from megatron_lite.tool_args import ToolParser, output_prefix, positive_int  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(prog="preprocess_data.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="jsonl, json, parquet, arrow or txt files, folders of them, or a "
                             "datasets.save_to_disk folder (a .txt file is one document)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="columns to tokenize; each becomes OUT_KEY_document (default: text)")
    parser.add_argument("--output-prefix", required=True, type=output_prefix,
                        help="where to write OUT_KEY_document.bin/.idx")
    parser.add_argument("--tokenizer-type", required=True, choices=sorted(TOKENIZER_TYPES))
    parser.add_argument("--tokenizer-model", help="sentencepiece .model, or tokenizer.json (or its folder)")
    parser.add_argument("--vocab-size", type=positive_int, help="vocab size for NullTokenizer")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--workers", type=positive_int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--dtype", choices=["uint8", "uint16", "int32", "int64"],
                        help="token dtype in the .bin (default: the smallest that holds the vocab)")
    parser.add_argument("--cache-dir", help="datasets cache for the parsed input (default: HF's)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
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
