#!/usr/bin/env bash
# The one command of a session lent a GPU (see ../shared/design/GPU_NOTES.md): the CUDA smoke checks, then the
# Llama-3.2-1B benchmark against transformers, every figure and log into $OUT, the folder that comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
export BENCHMARK_RESULTS_DIR=${OUT:?set OUT to the folder that comes back}
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
timeout 150 python -m benchmarks.gpu_smoke > "$OUT/gpu_smoke.log" 2>&1
echo "gpu_smoke exit $?"
timeout 360 python -m benchmarks.gpu_step > "$OUT/gpu_step.log" 2>&1
echo "gpu_step exit $?"
tail -n 30 "$OUT/gpu_smoke.log"
tail -n 60 "$OUT/gpu_step.log"
