"""Training from raw text on bad input: one line (a malformed record naming file and line; a missing, empty or
keyless source and a tokenizer without an end-of-document token before any model is built)."""

import gzip
import re
import sys
import time

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.errors import DataError
from megatron_lite.training.loop import pretrain
from tests.helpers import TINY_2_LAYERS
from tests.test_data_raw_text import random_documents, write_documents

VOCAB = 500


def raw_values(data_path, **extra):
    return {**TINY_2_LAYERS, "mock_data": False, "data_path": data_path, "split": "100,0,0",
            "tokenizer_type": "NullTokenizer", "vocab_size": VOCAB, "seq_length": 16, "max_position_embeddings": 16,
            "global_batch_size": 8, "train_iters": 8, "raw_text_chunk_mib": 512 / 2**20, **extra}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("raw_training") / "a.jsonl"
    write_documents(path, random_documents(60, 0))
    return str(path)


def _never_built(*args):
    raise AssertionError("the model was built before the data was refused")


def _train(values: dict, provider=pretrain_gpt.model_provider):
    return pretrain(make_config(values), provider, pretrain_gpt.forward_step)


def test_a_malformed_record_names_file_and_line_or_is_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    write_documents(path, random_documents(30, 2))
    lines = path.read_text().splitlines()
    lines[2] = '{"text": "1 2 3"'  # cut short
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:3: malformed JSON line .*--skip-bad-records N"):
        _train(raw_values([str(path)], train_iters=2))
    _train(raw_values([str(path)], train_iters=2, skip_bad_records=1))
    assert f"skipped bad record {path}:3: malformed JSON line" in capsys.readouterr().out
    lines[5] = '{"title": "no text here"}'
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"2 bad records, more than --skip-bad-records 1; the last: {path}:6: no text"):
        _train(raw_values([str(path)], train_iters=2, skip_bad_records=1))


def test_missing_empty_or_keyless_sources_are_refused_before_the_model_is_built(corpus, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    cases = [([str(tmp_path / "missing.jsonl")], {}, "raw text source .*missing.jsonl not found"),
             ([str(tmp_path / "empty.jsonl")], {}, "empty.jsonl is empty"),
             ([str(tmp_path / "blank.jsonl")], {}, "blank.jsonl holds no documents"),
             ([corpus], {"json_keys": ["content"]},
              r"a.jsonl:1: no text under --json-keys 'content' \(keys: text, id\)")]
    for data_path, extra, message in cases:
        with pytest.raises(DataError, match=message):
            _train(raw_values(data_path, **extra), _never_built)


def test_a_tokenizer_without_an_end_of_document_token_is_refused_before_the_model_is_built(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    values = raw_values([corpus], tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    with pytest.raises(DataError, match="has none of the end-of-document tokens"):
        _train(values, _never_built)


def test_the_log_line_reports_what_the_loader_tokenizes_per_second(corpus, monkeypatch, capsys):
    """A tokenizer made to take 10 ms a document: the loader (the main process, no workers on the CPU) can
    tokenize at most the longest document's 41 tokens per 10 ms, and at least what training consumed over the
    run's whole wall time (the loader's time is part of it)."""
    from megatron_lite.data.tokenizers import NullTokenizer

    tokenize = NullTokenizer.tokenize

    def slow_tokenize(self, text):
        time.sleep(0.01)
        return tokenize(self, text)

    monkeypatch.setattr(NullTokenizer, "tokenize", slow_tokenize)
    start = time.perf_counter()
    history = _train(raw_values([corpus], train_iters=3, log_interval=1))
    wall = time.perf_counter() - start
    consumed = 3 * 8 * 16
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    reported = [float(re.search(r"loader tokens/s ([\d,]+)", line).group(1).replace(",", "")) for line in lines]
    assert len(reported) == 3
    assert reported == [round(h["loader_tokens_per_sec"]) for h in history]
    for rate in reported:
        assert consumed / wall <= rate <= 41 / 0.01


def test_a_zstd_source_without_the_zstandard_package_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    import zstandard

    path = tmp_path / "a.jsonl.zst"
    write_documents(path, random_documents(10, 0), opener=zstandard.open)
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as when it is not installed: import raises ImportError
    with pytest.raises(DataError, match=rf"^reading {path} needs the zstandard package: pip install zstandard$"):
        _train(raw_values([str(path)]), _never_built)


def test_a_damaged_compressed_source_is_one_line_also_from_a_loader_worker(tmp_path):
    """A .gz cut short fails only where the reading gets to (past the first record, which is checked before the
    model is built), in a loader worker with --num-workers 1: still one line naming the file."""
    documents = random_documents(200, 3)
    write_documents(tmp_path / "whole.jsonl.gz", documents, opener=gzip.open)
    data = (tmp_path / "whole.jsonl.gz").read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError) as error:
        _train(raw_values([str(tmp_path / "cut.jsonl.gz")], num_workers=1))
    assert re.fullmatch(rf"{tmp_path}/cut.jsonl.gz cannot be decompressed after line \d+ \(Compressed file ended "
                        r"before the end-of-stream marker was reached\); replace the file with a complete gz file "
                        r"or leave it out", str(error.value))
    (tmp_path / "plain.jsonl.zst").write_text('{"text": "1 2 3"}\n')  # named .zst, not compressed
    with pytest.raises(DataError, match=rf"^{tmp_path}/plain.jsonl.zst cannot be decompressed after line 0 "
                                        r"\(zstd decompress(or)? error: .*\); replace the file with a complete "
                                        r"zst file"):
        _train(raw_values([str(tmp_path / "plain.jsonl.zst")]), _never_built)


def test_a_zstd_source_cut_short_names_the_damage_not_a_shorter_corpus(tmp_path):
    import zstandard

    documents = random_documents(2000, 4)
    write_documents(tmp_path / "whole.jsonl.zst", documents, opener=zstandard.open)
    data = (tmp_path / "whole.jsonl.zst").read_bytes()
    (tmp_path / "cut.jsonl.zst").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError) as error:
        _train(raw_values([str(tmp_path / "cut.jsonl.zst")]))
    assert re.fullmatch(rf"{tmp_path}/cut.jsonl.zst cannot be decompressed after line \d+ \(the file ends inside a "
                        r"zstd frame: it was cut short\); replace the file with a complete zst file or leave it out",
                        str(error.value))


def test_a_folder_that_looks_like_a_saved_dataset_but_is_not_is_one_line(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["1 2 3"]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "saved" / "state.json").write_text("{not json")
    with pytest.raises(DataError, match=rf"^{tmp_path}/saved looks like a saved dataset \(it holds state.json or "
                                        r"dataset_dict.json\) but cannot be loaded \(JSONDecodeError: .*\); save it "
                                        r"again with datasets' save_to_disk, or point --data-path at the raw files$"):
        _train(raw_values([str(tmp_path / "saved")]), _never_built)
