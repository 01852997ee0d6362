#!/usr/bin/env bash
# Install everything the tests need (into $VENV, default .venv) and run the whole test suite on CPU in
# $TEST_WORKERS pytest-xdist workers (default 3: on 2 cores a third overlaps the tests that wait on launches,
# hangs and timeouts with two that compute; a file each at a time, the dearest files first), printing the 25
# slowest tests. `--quick` runs the everyday subset of tests/quick_suite.txt instead; other arguments go to
# pytest. Per-file times of a full run: python -m benchmarks.test_durations.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
export OMP_NUM_THREADS=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest -q --durations=25 -n "${TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder \
    tests "$@"
