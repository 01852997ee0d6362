"""What each test file costs: the per-file seconds of a full test run, appended to
benchmarks/results/test_durations.jsonl with the date, the machine and its load, so that the suite's budget
(10 minutes on 2 cores) is watched between runs and a new slow file is seen in review.

Runs the suite as scripts/run_tests.sh does (three pytest-xdist workers, one thread per process, offline) with
pytest's JUnit report, or reads the report of a run already made (--junit). A file's time is the sum of its
tests' setup, call and teardown (pytest's junit `time`), so a module fixture counts in the file that starts it
and a shared gloo world in the first file of its worker that asks for it; with two workers the files overlap,
so their sum exceeds the run's wall time. The load average before and after says whether the cores were idle;
the machine's busy CPU-seconds over the run (all cores, from /proc/stat) say what the run cost whatever the
number of workers, and, beside the wall time, how busy the cores were.

    python -m benchmarks.test_durations [--label before] [--junit report.xml] [-- pytest arguments]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

from benchmarks.results_file import record_result

SUITE_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
SUITE_ARGUMENTS = ["-n", "3", "--dist", "loadfile", "--no-loadscope-reorder", "tests"]  # as scripts/run_tests.sh


def cpu_model() -> str:
    """The processor's name as the kernel reports it (platform.processor() is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def busy_cpu_seconds() -> float | None:
    """CPU-seconds every core of this machine has spent busy since boot (user, system, interrupts, stolen), or
    None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(value) for value in f.readline().split()[1:9]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def read_report(path: str) -> dict:
    """Per-file seconds and outcome counts from a pytest JUnit report."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    seconds: dict[str, float] = collections.defaultdict(float)
    tests: dict[str, int] = collections.defaultdict(int)
    slowest = []
    outcomes = collections.Counter()
    for suite in suites:
        for case in suite.iter("testcase"):
            module = case.get("classname", "").split(".")
            file = "/".join(module[:2]) + ".py" if len(module) >= 2 else case.get("file", "?")
            duration = float(case.get("time", 0.0))
            seconds[file] += duration
            tests[file] += 1
            slowest.append((duration, f"{file}::{case.get('name')}"))
            outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
            outcomes[outcome] += 1
    files = sorted(seconds, key=seconds.get, reverse=True)
    return {"suite_seconds": round(sum(float(s.get("time", 0.0)) for s in suites), 1),
            "outcomes": dict(outcomes),
            "files": {file: {"seconds": round(seconds[file], 1), "tests": tests[file]} for file in files},
            "slowest_tests": [{"test": name, "seconds": round(d, 1)} for d, name in sorted(slowest, reverse=True)[:15]]}


def run_suite(report: str, pytest_arguments: list[str]) -> tuple[int, float]:
    """Run the suite into `report`; (exit code, wall seconds)."""
    start = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
               *(pytest_arguments or SUITE_ARGUMENTS)]
    code = subprocess.call(command, env={**os.environ, **SUITE_ENVIRONMENT})
    return code, time.monotonic() - start


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junit", help="read this JUnit report of a run already made instead of running the suite")
    parser.add_argument("--label", default="", help="what the run is (before, after, a commit), kept in the record")
    parser.add_argument("pytest_arguments", nargs="*",
                        help="after --: what to run (default: the suite as scripts/run_tests.sh runs it)")
    args = parser.parse_args(argv[1:])
    load_before = os.getloadavg()
    figures = {"label": args.label, "cpu": cpu_model(), "load_average_before": [round(x, 2) for x in load_before]}
    if args.junit:
        figures.update(read_report(args.junit), report=args.junit)
        code = 0
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.xml")
            busy_before = busy_cpu_seconds()
            code, wall = run_suite(report, args.pytest_arguments)
            busy_after = busy_cpu_seconds()
            if not os.path.exists(report):
                print(f"pytest wrote no report (exit code {code})", file=sys.stderr)
                return code or 1
            figures.update(read_report(report), wall_seconds=round(wall, 1), exit_code=code)
            if busy_before is not None and busy_after is not None:
                cpu_seconds = busy_after - busy_before
                figures.update(cpu_seconds=round(cpu_seconds, 1),
                               cores_busy=round(cpu_seconds / (wall * (os.cpu_count() or 1)), 3))
    figures["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    cost = f" ({figures['cpu_seconds']:.0f} CPU-seconds)" if "cpu_seconds" in figures else ""
    print(f"{figures['suite_seconds']:.0f} s in tests{cost}, {figures['outcomes']}; the ten slowest files:")
    for file, entry in list(figures["files"].items())[:10]:
        print(f"  {entry['seconds']:7.1f} s  {entry['tests']:4d} tests  {file}")
    record_result("test_durations", figures, argv)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
