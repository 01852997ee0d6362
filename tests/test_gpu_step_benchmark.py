"""benchmarks/gpu_step.py runs end to end (on a tiny model on the CPU), so the GPU benchmark never rots."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_step_benchmark_runs_every_part_on_a_tiny_model():
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", "--tiny"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    figures = json.loads("\n".join(lines[lines.index("{"):]))
    assert all(check["passed"] for check in figures["correctness"].values()), figures["correctness"]
    for run in ("megatron_lite", "transformers_eager", "transformers_compiled"):
        assert figures[run]["tokens_per_sec"] > 0 and figures[run]["tflops_per_device"] > 0
    ours = figures["megatron_lite"]
    assert ours["time_forward_backward_ms"] > 0 and ours["time_optimizer_ms"] > 0
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ours["attention_kernels"]
    assert figures["ratio_vs_transformers_eager"] == pytest.approx(
        ours["tokens_per_sec"] / figures["transformers_eager"]["tokens_per_sec"])
