#!/usr/bin/env bash
# The commands of a session lent a GPU (see ../shared/design/GPU_NOTES.md), every figure and log into $OUT, the
# folder that comes back. Each part has its own time limit; one `run` call takes at most 600 s, so:
#   bash scripts/gpu_session.sh            # smoke checks (150 s), then the Llama-3.2-1B benchmark (360 s)
#   bash scripts/gpu_session.sh fp8        # FP8 against bf16 on 4 Llama-3-8B layers and the 1B shape (300 s)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export BENCHMARK_RESULTS_DIR=${OUT:?set OUT to the folder that comes back}
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(smoke step)
for part in "${parts[@]}"; do
  case $part in
    smoke) limit=150 module=benchmarks.gpu_smoke ;;
    step) limit=360 module=benchmarks.gpu_step ;;
    fp8) limit=300 module=benchmarks.fp8_gpu ;;
    *) echo "unknown part '$part': choose smoke, step or fp8"; exit 2 ;;
  esac
  timeout "$limit" python -m "$module" > "$OUT/$part.log" 2>&1
  echo "$part exit $?"
  tail -n 60 "$OUT/$part.log"
done
