"""Bad input fails on every rank with one clear line and a non-zero exit, quickly, before any collective."""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_on_every_rank_with_one_line(case):
    argv, expected = CASES[case]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "pretrain_gpt.py", *argv]
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error (rank")]
    assert sorted(line.split(")")[0] for line in error_lines) == ["error (rank 0", "error (rank 1"]
    assert all(expected in line for line in error_lines), error_lines
    assert elapsed < 10, f"took {elapsed:.1f}s"
