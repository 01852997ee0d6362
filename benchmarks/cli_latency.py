"""How fast a command line is answered: `--help` and a mistake in a flag, for pretrain_gpt.py and every tool,
against the floor the old design paid before any of them (importing torch), measured in the same run.

Each command runs in a fresh interpreter, as a user types it, `--repeats` times; the figure is the median wall
time. The mistakes are the classes the checks catch before torch is imported: a value argparse refuses, a
flag that acts only with another (flag_dependencies.py), a layout validation refuses.

    python -m benchmarks.cli_latency [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from benchmarks.results_file import record_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model-preset", "llama-tiny", "--mock-data"]
COMMANDS = {  # name -> (argv after the interpreter, the exit status it must give)
    "import torch (the floor of the old design)": (["-c", "import torch"], 0),
    "pretrain_gpt.py --help": (["pretrain_gpt.py", "--help"], 0),
    "pretrain_gpt.py --lr abc": (["pretrain_gpt.py", *TINY, "--lr", "abc"], 2),
    "pretrain_gpt.py --fp8-recipe rowwise (no --fp8-format)": (["pretrain_gpt.py", *TINY, "--fp8-recipe", "rowwise"],
                                                               2),
    "pretrain_gpt.py --tensor-model-parallel-size 3 (4 heads)": (
        ["pretrain_gpt.py", *TINY, "--tensor-model-parallel-size", "3"], 2),
    "convert_checkpoint.py --help": (["tools/convert_checkpoint.py", "--help"], 0),
    "convert_checkpoint.py --direction sideways": (
        ["tools/convert_checkpoint.py", "--direction", "sideways", "--load-dir", "a", "--save-dir", "b"], 2),
    "generate.py --help": (["tools/generate.py", "--help"], 0),
    "generate.py --top-p 2": (["tools/generate.py", "--load", "x", "--prompt-ids", "1", "--top-p", "2"], 2),
    "inspect_checkpoint.py --help": (["tools/inspect_checkpoint.py", "--help"], 0),
    "inspect_checkpoint.py --iteration -1": (["tools/inspect_checkpoint.py", "x", "--iteration", "-1"], 2),
    "plan_layout.py --help": (["tools/plan_layout.py", "--help"], 0),
    "plan_layout.py --world-size 0": (["tools/plan_layout.py", "--world-size", "0", *TINY], 2),
    "preprocess_data.py --help": (["tools/preprocess_data.py", "--help"], 0),
    "train_tokenizer.py --help": (["tools/train_tokenizer.py", "--help"], 0),
    "merge_datasets.py --help": (["tools/merge_datasets.py", "--help"], 0),
    "checkpoint_kill_drill.py --help": (["tools/checkpoint_kill_drill.py", "--help"], 0),
    "plot_metrics.py --help": (["tools/plot_metrics.py", "--help"], 0),
    "download_demo_corpus.py --help": (["tools/download_demo_corpus.py", "--help"], 0),
}


def seconds(argv: list[str], status: int) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    elapsed = time.perf_counter() - start
    if done.returncode != status:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}, not {status}: {done.stderr.strip()[-300:]}")
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    medians = {}
    for name, (command, status) in COMMANDS.items():
        medians[name] = round(statistics.median(seconds(command, status) for _ in range(args.repeats)), 3)
        print(f"{medians[name]:7.3f} s  {name}", flush=True)
    answers = {name: value for name, value in medians.items() if not name.startswith("import torch")}
    load = os.getloadavg()[0]
    print(f"slowest answer {max(answers.values()):.3f} s; import torch alone {medians[next(iter(COMMANDS))]:.3f} s "
          f"(load average {load:.1f})")
    record_result("cli_latency", {"repeats": args.repeats, "load_average": round(load, 2), "median_seconds": medians,
                                  "slowest_answer_seconds": max(answers.values())}, sys.argv)


if __name__ == "__main__":
    main()
