"""Session-wide test settings: one thread per process, no launcher's variables, the imported modules frozen
for the garbage collector, the shared gloo worlds closed at the end; the files' order and the --quick subset."""

import gc
import json
import os

# Tests run the entry point inside this process; a suite started under srun or torchrun must not hand it the
# launcher's rank variables (or make it watch this process's parent).
for _name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC_"))] + [
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]:
    os.environ.pop(_name, None)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.harness import close_all_worlds  # noqa: E402

torch.set_num_threads(1)


QUICK_SUITE = os.path.join(os.path.dirname(__file__), "quick_suite.txt")
DURATIONS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "results", "test_durations.jsonl")


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="run only the everyday subset listed in tests/quick_suite.txt (a few minutes on 2 cores)")


def quick_suite_entries() -> list[str]:
    """The node ids (a file, or file::test with or without its parameters) of the quick suite."""
    with open(QUICK_SUITE) as f:
        lines = (line.split("#", 1)[0].strip() for line in f)
        return [line for line in lines if line]


def recorded_file_seconds() -> dict[str, float]:
    """Seconds per test file in the newest whole-suite record of benchmarks/results/test_durations.jsonl."""
    try:
        with open(DURATIONS) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return {}
    whole = [record for record in records if len(record.get("files", {})) > 50]
    return {file: entry["seconds"] for file, entry in whole[-1]["files"].items()} if whole else {}


def pytest_collection_modifyitems(config, items):
    """Files in the order of their recorded cost, the dearest first, so that two test workers (pytest-xdist, one
    file each at a time) start the long ones early instead of ending on them; then, with --quick, keep the tests
    that quick_suite.txt names (on a run of whole folders an entry that names no collected test fails the run,
    so the list cannot go stale unseen when a test is renamed)."""
    seconds = recorded_file_seconds()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))
    if not config.getoption("quick"):
        return
    entries = quick_suite_entries()
    chosen, used = [], set()
    for item in items:
        node = item.nodeid
        matches = [e for e in entries if node == e or node.startswith(e + "::") or node.startswith(e + "[")]
        if matches:
            chosen.append(item)
            used.update(matches)
    whole_suite = all(os.path.isdir(arg) for arg in config.args)
    stale = [e for e in entries if e not in used]
    if whole_suite and stale:
        raise pytest.UsageError(f"tests/quick_suite.txt names tests that do not exist: {', '.join(stale)}")
    kept = {id(item) for item in chosen}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = chosen


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, the package, every test module: ~365k objects), which lives as
    long as the session: every in-process training run collects garbage twice (lifecycle.shutdown), and each
    collection that traversed them took 0.2 s. Objects made by the tests themselves are collected as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_each_file_leaves():
    """After each file, collect its garbage and freeze what is left (the modules it imported lazily, such as
    transformers' model families, megatron-core or lm-eval, and the session's caches): unfrozen, they made every
    later collection of a test worker slower (300k objects by the end of a run, 60 CPU-seconds of collections
    in the three workers)."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _close_worlds():
    yield
    close_all_worlds()


@pytest.fixture(scope="module")
def idle_machine():
    """For modules that time whole torchrun jobs: the shared test worlds of other modules would only compete
    with them for the cores, so they are closed first (the next module that needs one starts it again)."""
    close_all_worlds()
