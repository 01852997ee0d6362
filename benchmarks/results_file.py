"""Append a benchmark's figures, with the date, machine and command, to <results folder>/<name>.jsonl: the
folder $BENCHMARK_RESULTS_DIR names (a borrowed GPU machine's output folder, whose copy of the tree does not
come back), else benchmarks/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    """What the figures were measured on."""
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "processor": platform.processor()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def record_result(name: str, figures: dict, argv: list[str]) -> str:
    directory = os.environ.get("BENCHMARK_RESULTS_DIR") or RESULTS_DIR
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.jsonl")
    entry = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "machine": machine(), "command": "python -m benchmarks." + " ".join([name, *argv[1:]]), **figures}
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
    print(f"results appended to {os.path.relpath(path)}")
    return path
