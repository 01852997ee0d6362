"""benchmarks/fp8_gpu.py runs end to end (tiny models on the CPU), so the FP8 GPU benchmark never rots."""

import pytest

from benchmarks import fp8_gpu


def test_fp8_gpu_benchmark_runs_every_part_on_tiny_models():
    figures = fp8_gpu.main(["--tiny"])
    for case in ("llama3_8b_4_layers", "llama3.2_1b"):
        runs = figures[case]["runs"]
        assert set(runs) == {"bf16", "fp8 tensorwise", "fp8 rowwise"}
        for name, run in runs.items():
            assert run["tokens_per_sec"] > 0 and run["tflops_per_device"] > 0, (case, name)
            assert len(run["losses"]) == figures[case]["iters"]
            if name != "bf16":
                assert run["speedup_vs_bf16"] == pytest.approx(run["tokens_per_sec"] / runs["bf16"]["tokens_per_sec"])
                assert abs(run["final_loss_vs_bf16"]) < 0.01, (case, name)  # the bound, met on the CPU
                assert run["losses"] != runs["bf16"]["losses"], (case, name)  # FP8 GEMMs did run

