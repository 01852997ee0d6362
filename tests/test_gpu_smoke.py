"""benchmarks/gpu_smoke.py, the GPU's one-command check of every CUDA-only path, runs its checks on the CPU
too, so that the script is known to work before a GPU's minutes are spent on it."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_smoke_checks_pass_on_the_cpu():
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_smoke", "--cpu"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = result.stdout.splitlines()
    figures = json.loads("\n".join(lines[lines.index("{"):]))
    assert result.returncode == 0, json.dumps(figures)[-3000:]
    checks = ("flex_documents", "cp_block_kernels", "moe_grouped_gemm", "fused_adamw", "training")
    assert all(figures[name]["passed"] for name in checks) and figures["passed"]
    assert set(figures["training"]["errors"]) == {"offload_vs_device", "resumed_vs_uninterrupted"}
    assert figures["training"]["resumed_iterations"] == [3, 4] and figures["training"]["trace_bytes"] > 0
    assert len(figures["cp_block_kernels"]["cases"]) == 2  # causal square and a non-causal short block
