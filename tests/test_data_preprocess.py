"""Preprocessing writes every token of every document once, in order, from any supported input."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.data.indexed_dataset import IndexedDataset
from megatron_lite.data.preprocess import preprocess
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.errors import DataError

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = ["To be, or not to be, that is the question:", "", "Whether 'tis nobler in the mind to suffer\n"
             "The slings and arrows of outrageous fortune,", "Or to take arms — against a sea of troubles",
             "Ay, there's the rub!"]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCUMENTS * 10, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def run(inputs, tmp_path, tokenizer_json, **options):
    options = {"append_eod": True, "progress": False, "cache_dir": str(tmp_path / "hf"), **options}
    stats = preprocess([str(i) for i in inputs], str(tmp_path / "out"), options.pop("json_keys", ["text"]),
                       "HuggingFaceTokenizer", tokenizer_json, **options)
    return stats, IndexedDataset(str(tmp_path / "out_text_document"))


def expected_documents(tokenizer_json, documents=DOCUMENTS):
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_json)
    return [tok.tokenize(d) + [tok.eod] for d in documents if d]


def write_jsonl(path, documents=DOCUMENTS):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(documents)))
    return path


def test_every_token_of_every_document_appears_once_in_order(tmp_path, tokenizer_json):
    stats, ds = run([write_jsonl(tmp_path / "in.jsonl")], tmp_path, tokenizer_json)
    expected = expected_documents(tokenizer_json)
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    flat = np.fromfile(tmp_path / "out_text_document.bin", dtype=ds.dtype)
    assert flat.tolist() == sum(expected, [])
    assert ds.dtype == np.uint16  # the smallest dtype that holds a 400-token vocab
    s = stats["text"]
    assert (s.documents, s.empty_documents, s.tokens) == (4, 1, len(flat))


def test_two_workers_write_the_same_bytes_as_one(tmp_path, tokenizer_json):
    many = [f"{d} ({i})" for i in range(300) for d in DOCUMENTS]
    write_jsonl(tmp_path / "in.jsonl", many)
    run([tmp_path / "in.jsonl"], tmp_path, tokenizer_json, workers=1)
    one = {ext: (tmp_path / f"out_text_document.{ext}").read_bytes() for ext in ("bin", "idx")}
    run([tmp_path / "in.jsonl"], tmp_path, tokenizer_json, workers=2)
    two = {ext: (tmp_path / f"out_text_document.{ext}").read_bytes() for ext in ("bin", "idx")}
    assert one == two


def _write_format(kind, tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"text": DOCUMENTS, "id": list(range(len(DOCUMENTS)))})
    if kind == "json array":
        (tmp_path / "in.json").write_text(json.dumps([{"text": d} for d in DOCUMENTS]))
        return [tmp_path / "in.json"]
    if kind == "parquet":
        table.to_parquet(str(tmp_path / "in.parquet"))
        return [tmp_path / "in.parquet"]
    if kind == "arrow":
        table.save_to_disk(str(tmp_path / "saved"))
        (arrow,) = (tmp_path / "saved").glob("*.arrow")
        return [arrow]
    if kind == "save_to_disk folder":
        table.save_to_disk(str(tmp_path / "saved"))
        return [tmp_path / "saved"]
    if kind == "folder of jsonl":
        (tmp_path / "shards").mkdir()
        write_jsonl(tmp_path / "shards" / "0.jsonl", DOCUMENTS[:2])
        write_jsonl(tmp_path / "shards" / "1.jsonl", DOCUMENTS[2:])
        return [tmp_path / "shards"]
    if kind == "txt":  # one document per file
        for i, d in enumerate(DOCUMENTS):
            (tmp_path / f"{i}.txt").write_text(d)
        return [tmp_path / f"{i}.txt" for i in range(len(DOCUMENTS))]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["json array", "parquet", "arrow", "save_to_disk folder", "folder of jsonl", "txt"])
def test_each_input_format_gives_the_same_documents(kind, tmp_path, tokenizer_json):
    _, ds = run(_write_format(kind, tmp_path), tmp_path, tokenizer_json)
    assert [ds[i].tolist() for i in range(len(ds))] == expected_documents(tokenizer_json)


def test_each_json_key_becomes_its_own_dataset(tmp_path, tokenizer_json):
    rows = [{"text": d, "title": d[:10]} for d in DOCUMENTS]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stats, _ = run([tmp_path / "in.jsonl"], tmp_path, tokenizer_json, json_keys=["text", "title"])
    titles = IndexedDataset(str(tmp_path / "out_title_document"))
    expected = expected_documents(tokenizer_json, [r["title"] for r in rows])
    assert [titles[i].tolist() for i in range(len(titles))] == expected
    assert stats["title"].documents == len(expected)


@pytest.mark.parametrize("content, message", [
    (b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "broken\n', r"in.jsonl:3: malformed JSON"),
    (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"in.jsonl:2: bytes that are not UTF-8"),
])
def test_bad_lines_are_reported_with_file_and_line(content, message, tmp_path, tokenizer_json):
    (tmp_path / "in.jsonl").write_bytes(content)
    with pytest.raises(ValueError, match=message) as error:
        run([tmp_path / "in.jsonl"], tmp_path, tokenizer_json)
    assert "\n" not in str(error.value)
    assert not list(tmp_path.glob("out*"))


def test_unknown_json_key_lists_the_columns(tmp_path, tokenizer_json):
    with pytest.raises(ValueError, match=r"'content' is not a column .*columns: text, id"):
        run([write_jsonl(tmp_path / "in.jsonl")], tmp_path, tokenizer_json, json_keys=["content"])


def test_missing_input_is_named(tmp_path, tokenizer_json):
    with pytest.raises(FileNotFoundError, match="nope.jsonl not found"):
        run([tmp_path / "nope.jsonl"], tmp_path, tokenizer_json)


def test_vocab_larger_than_the_dtype_is_refused(tmp_path):
    (tmp_path / "ids.jsonl").write_text(json.dumps({"text": "1 2 70000"}) + "\n")
    with pytest.raises(ValueError, match=r"vocab \(70001 ids\) exceeds dtype uint16"):
        preprocess([str(tmp_path / "ids.jsonl")], str(tmp_path / "out"), ["text"], "NullTokenizer",
                   vocab_size=70001, dtype="uint16", progress=False, cache_dir=str(tmp_path / "hf"))


def test_script_runs_from_the_repo_root_and_fails_in_one_line(tmp_path):
    help_text = subprocess.run([sys.executable, "tools/preprocess_data.py", "--help"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout
    assert "--append-eod" in help_text and "--workers" in help_text
    failed = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "none.jsonl"),
                             "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "NullTokenizer",
                             "--vocab-size", "10"], cwd=REPO, capture_output=True, text=True)
    assert failed.returncode != 0
    assert failed.stderr.strip().splitlines() == [f"preprocess_data.py: error: input {tmp_path}/none.jsonl "
                                                  f"not found; check --input"]


def test_an_input_without_text_writes_no_dataset(tmp_path, tokenizer_json):
    write_jsonl(tmp_path / "in.jsonl", ["", "", ""])
    with pytest.raises(DataError, match=r"no documents with text under --json-keys text \(3 empty ones\); "
                                        r"nothing was written"):
        run([tmp_path / "in.jsonl"], tmp_path, tokenizer_json)
    assert not list(tmp_path.glob("out*"))


def test_empty_input_files_are_refused_in_one_line(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text("")
    failed = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "a.jsonl"),
                             str(tmp_path / "b.jsonl"), "--output-prefix", str(tmp_path / "out"),
                             "--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
                            cwd=REPO, capture_output=True, text=True)
    assert failed.returncode != 0
    assert failed.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: every input file is empty ({tmp_path}/a.jsonl, {tmp_path}/b.jsonl); "
        f"there are no documents to preprocess"]
    assert not list(tmp_path.glob("out*"))
