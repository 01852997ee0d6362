"""Concatenate several .bin/.idx datasets (same token dtype) into one, in the order given.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from megatron_lite.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402
from megatron_lite.tool_args import ToolParser, output_prefix  # noqa: E402


def merge_datasets(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Write `output_prefix`.bin/.idx holding every document of `prefixes`, in order."""
    first = IndexedDataset(prefixes[0])
    builder = IndexedDatasetBuilder(output_prefix, first.dtype)
    try:
        for prefix in tqdm(prefixes, unit="dataset", desc="merging"):
            builder.add_index(prefix)
        builder.finalize()
    except BaseException:
        builder.abort()
        raise
    return IndexedDataset(output_prefix)


def main(argv=None) -> None:
    parser = ToolParser(prog="merge_datasets.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="dataset prefixes (without .bin/.idx)")
    parser.add_argument("--output-prefix", required=True, type=output_prefix, help="prefix of the merged dataset")
    args = parser.parse_args(argv)
    try:
        merged = merge_datasets(args.input, args.output_prefix)
    except ValueError as error:  # a DataError naming the dataset, a dtype that differs
        sys.exit(f"merge_datasets.py: error: {error}")
    except OSError as error:  # an output prefix that cannot be written
        sys.exit(f"merge_datasets.py: error: cannot write {error.filename}: {error.strerror}")
    print(f"wrote {args.output_prefix}.bin/.idx: {len(merged.document_indices) - 1} documents, "
          f"{merged.num_tokens} tokens")


if __name__ == "__main__":
    main()
