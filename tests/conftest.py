"""Session-wide test settings: one thread per process, no launcher's variables, the imported modules frozen
for the garbage collector, and the shared gloo worlds closed at the end."""

import gc
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


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, the package, every test module: ~365k objects), which lives as
    long as the session: every in-process training run collects garbage twice (lifecycle.shutdown), and each
    collection that traversed them took 0.2 s. Objects made by the tests themselves are collected as before."""
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
