"""benchmarks/gpu_step.py runs end to end (on a tiny model on the CPU), so the GPU benchmark never rots."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.results_file import record_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_gpu_step_benchmark_runs_every_part_on_a_tiny_model():
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_step", "--tiny"], cwd=ROOT, capture_output=True,
                            text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    figures = json.loads("\n".join(lines[lines.index("{"):]))
    assert all(check["passed"] for check in figures["correctness"].values()), figures["correctness"]
    assert set(figures["correctness"]) == {"fp32_vs_cpu", "bf16_vs_fp32", "compiled_vs_eager"}
    for run in ("megatron_lite", "megatron_lite_compiled", "transformers_eager", "transformers_compiled"):
        assert figures[run]["tokens_per_sec"] > 0 and figures[run]["tflops_per_device"] > 0
    for name in ("megatron_lite", "megatron_lite_compiled"):
        ours = figures[name]
        assert ours["time_forward_backward_ms"] > 0 and ours["time_optimizer_ms"] > 0
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ours["attention_kernels"]
        for peer in ("transformers_eager", "transformers_compiled"):
            assert figures[f"ratio_{name}_vs_{peer}"] == pytest.approx(
                ours["tokens_per_sec"] / figures[peer]["tokens_per_sec"])


def test_benchmark_results_go_to_the_folder_the_environment_names(tmp_path, monkeypatch):
    """A borrowed GPU machine sends back only its output folder, so figures must be written there."""
    monkeypatch.setenv("BENCHMARK_RESULTS_DIR", str(tmp_path / "out"))
    path = record_result("probe", {"figure": 1.5}, ["benchmarks.probe", "--flag"])
    assert path == str(tmp_path / "out" / "probe.jsonl")
    with open(path) as f:
        (entry,) = map(json.loads, f)
    assert entry["figure"] == 1.5 and entry["command"] == "python -m benchmarks.probe --flag"
    assert not os.path.exists(os.path.join(ROOT, "benchmarks", "results", "probe.jsonl"))
