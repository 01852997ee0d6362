"""benchmarks/test_durations.py: what a JUnit report says per file, and the machine's busy CPU-seconds."""

import time

import pytest

from benchmarks.test_durations import busy_cpu_seconds, read_report

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" time="9.5">
  <testcase classname="tests.test_a" name="test_one" time="2.0"/>
  <testcase classname="tests.test_a" name="test_two" time="3.5"><failure message="x"/></testcase>
  <testcase classname="tests.test_b" name="test_three" time="4.0"><skipped message="y"/></testcase>
</testsuite></testsuites>
"""


def test_a_report_gives_each_files_seconds_tests_and_outcomes(tmp_path):
    path = tmp_path / "report.xml"
    path.write_text(REPORT)
    figures = read_report(str(path))
    assert figures["suite_seconds"] == 9.5
    assert figures["files"] == {"tests/test_a.py": {"seconds": 5.5, "tests": 2},
                                "tests/test_b.py": {"seconds": 4.0, "tests": 1}}
    assert list(figures["files"]) == ["tests/test_a.py", "tests/test_b.py"]  # the dearest first
    assert figures["outcomes"] == {"passed": 1, "failure": 1, "skipped": 1}
    assert figures["slowest_tests"][0] == {"test": "tests/test_b.py::test_three", "seconds": 4.0}


def test_the_busy_cpu_seconds_hold_this_process_s_own():
    """The machine's busy time grows by at least what this process spent (other processes only add to it)."""
    before, own_before = busy_cpu_seconds(), time.process_time()
    if before is None:
        pytest.skip("no /proc/stat on this machine")
    while time.process_time() - own_before < 0.3:
        pass
    after, own = busy_cpu_seconds(), time.process_time() - own_before
    assert after - before >= own - 0.05  # the kernel counts in clock ticks (10 ms)
