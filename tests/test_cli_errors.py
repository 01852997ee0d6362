"""Bad input fails on every rank with one clear line and a non-zero exit, before any collective or step."""

import struct

import numpy as np
import pytest

from tests.harness import run_entry_on_ranks

BASE = ["--model-preset", "llama-tiny", "--mock-data", "--train-iters", "2"]

CASES = {
    "world size not divisible by the layout": (BASE + ["--tensor-model-parallel-size", "3"],
                                               "must be divisible by tensor-model-parallel-size"),
    "heads not divisible by query groups": (BASE + ["--num-attention-heads", "4", "--num-query-groups", "3"],
                                            "must be divisible by num-query-groups (3)"),
    "global batch not divisible": (BASE + ["--micro-batch-size", "2", "--global-batch-size", "6"],
                                   "global-batch-size (6) must be divisible by micro-batch-size (2) x data-parallel"),
    "unknown preset": (["--model-preset", "llama-huge", "--mock-data"], "unknown --model-preset 'llama-huge'"),
    "seq-length above learned positions": (
        ["--model-preset", "gpt2-124m", "--mock-data", "--seq-length", "2048"],
        "seq-length (2048) exceeds max-position-embeddings (1024)"),
    "no data": (["--model-preset", "llama-tiny"], "pass --data-path PREFIX"),
    "micro-batch of zero and a NaN learning rate": (BASE + ["--micro-batch-size", "0", "--min-lr", "nan"],
                                                    "min-lr (nan) must be a finite number; micro-batch-size (0) "
                                                    "must be at least 1"),
}


def fails_on_every_rank_with_one_line(argv: list[str], expected: str) -> None:
    """Run `argv` on two ranks; assert both print one `error (rank R): ...` line holding `expected`, exit
    non-zero and train no step. A rank left waiting in a collective would hold the run until the process-group
    timeout (10 minutes): the limit of the run, well below it, fails the test instead."""
    runs = run_entry_on_ranks(2, argv)
    assert all(run.code != 0 for run in runs), [run.code for run in runs]
    stderr = "".join(run.stderr for run in runs)
    error_lines = [line for line in stderr.splitlines() if line.startswith("error (rank")]
    assert sorted(line.split(")")[0] for line in error_lines) == ["error (rank 0", "error (rank 1"], stderr
    assert all(expected in line for line in error_lines), error_lines
    assert all(" iteration " not in run.stdout for run in runs), runs[0].stdout[-2000:]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_on_every_rank_with_one_line(case):
    fails_on_every_rank_with_one_line(*CASES[case])


def test_a_yaml_string_for_a_switch_fails_on_every_rank_with_one_line(tmp_path):
    (tmp_path / "run.yaml").write_text('model_preset: llama-tiny\nmock_data: "false"\n')
    fails_on_every_rank_with_one_line(["--config", str(tmp_path / "run.yaml")], "mock_data must be true or false")


def _write_pair(prefix, tokens: np.ndarray, idx_dtype_code: int) -> None:
    """One document of `tokens` in the .bin, described by an .idx that claims dtype code `idx_dtype_code`."""
    (prefix.parent / (prefix.name + ".bin")).write_bytes(tokens.tobytes())
    (prefix.parent / (prefix.name + ".idx")).write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, idx_dtype_code, 1, 2)
        + struct.pack("<i", tokens.size) + struct.pack("<q", 0) + struct.pack("<2q", 0, 1))


DATA_CASES = {
    # int32 tokens behind an .idx that says uint16: read as uint16, every other token would be a zero
    "bin in another dtype than its idx": (np.arange(500, dtype=np.int32), 8, [],
                                          "the .bin and .idx do not belong together"),
    # llama-tiny has 1024 ids; at TP2 an id past the vocabulary gave an infinite loss and exit 0
    "token ids past the vocabulary at TP2": (np.arange(500, dtype=np.uint16) * 4, 8,
                                             ["--tensor-model-parallel-size", "2"],
                                             "holds token id 1996, but the model's vocabulary has 1024 ids"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_data_that_lies_fails_on_every_rank_before_training(case, tmp_path):
    tokens, idx_dtype_code, flags, expected = DATA_CASES[case]
    _write_pair(tmp_path / "corpus", tokens, idx_dtype_code)
    argv = ["--model-preset", "llama-tiny", "--num-layers", "2", "--seq-length", "16", "--max-position-embeddings",
            "16", "--tokenizer-type", "NullTokenizer", "--data-path", str(tmp_path / "corpus"), "--split", "1",
            "--train-iters", "2", "--device", "cpu", "--metrics-jsonl", str(tmp_path / "metrics.jsonl"), *flags]
    fails_on_every_rank_with_one_line(argv, expected)
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
