"""--help and a mistake in a flag are answered before torch is imported, by pretrain_gpt.py and every tool: the
answer costs an interpreter and the parser, not the seconds (tens on a loaded machine) of importing torch.
benchmarks/cli_latency.py measures the times; this checks what is imported."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model-preset", "llama-tiny", "--mock-data"]
# What runs the entry point as `python FILE ARGS` would, then says whether torch was imported and how it exited.
PROBE = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    status = 0
except SystemExit as exit_:
    status = exit_.code if isinstance(exit_.code, int) else 1
print("torch imported" if "torch" in sys.modules else "torch not imported", status, file=sys.stderr)
"""
TOOLS = sorted(name for name in os.listdir(os.path.join(ROOT, "tools")) if name.endswith(".py"))
MISTAKES = {  # entry point -> a flag mistake it must answer without torch
    "pretrain_gpt.py": [*TINY, "--fp8-recipe", "rowwise"],
    "tools/convert_checkpoint.py": ["--direction", "sideways", "--load-dir", "a", "--save-dir", "b"],
    "tools/generate.py": ["--load", "x", "--prompt-ids", "1", "--top-p", "2"],
    "tools/inspect_checkpoint.py": ["x", "--iteration", "-1"],
    "tools/plan_layout.py": ["--world-size", "0", *TINY],
    "tools/checkpoint_kill_drill.py": ["--nproc", "0"],
    "tools/preprocess_data.py": ["--input", "x", "--workers", "0"],
}


def _probe(entry: str, args: list[str]) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", PROBE, entry, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)
    imported, status = done.stderr.strip().splitlines()[-1].rsplit(" ", 1)
    return imported, int(status)


@pytest.mark.parametrize("entry", ["pretrain_gpt.py", *[f"tools/{name}" for name in TOOLS]])
def test_help_is_answered_without_importing_torch(entry):
    assert _probe(entry, ["--help"]) == ("torch not imported", 0)


@pytest.mark.parametrize("entry", sorted(MISTAKES))
def test_a_flag_mistake_is_refused_without_importing_torch(entry):
    assert _probe(entry, MISTAKES[entry]) == ("torch not imported", 2)


def test_the_mistake_of_a_multi_rank_layout_is_refused_without_importing_torch():
    assert _probe("pretrain_gpt.py", [*TINY, "--tensor-model-parallel-size", "3"]) == ("torch not imported", 2)
