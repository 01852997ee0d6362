#!/usr/bin/env bash
# Create (or reuse) the virtual environment $VENV (default .venv) with megatron_lite and its test tools.
# torch is pinned to $TORCH (default 2.13.0) only when it is missing (the CPU build where one lies on local
# disk, the registry's build elsewhere); pyproject itself accepts any torch >= 2.11.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==${TORCH:-2.13.0}"
"$VENV/bin/python" -m pip install -q -e ".[test,hf]"
