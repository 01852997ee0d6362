"""Multi-rank test harness: persistent gloo worlds of N CPU processes that run test functions.

Starting a world costs seconds per rank (importing torch, joining the group), so a world of each size
is started once per test session and reused: `run_on_ranks(n, fn, *args)` runs `fn(*args)` on every
rank of the n-rank world and returns the per-rank results in rank order. `fn` must be a module-level
function (it is sent by reference) and its result picklable. A rank's exception is re-raised here with
its traceback; a run that exceeds its timeout kills the world and fails instead of hanging. Either way
the world is discarded and the next call starts a fresh one. A worker whose test process has been killed
exits within seconds (it would otherwise wait on its task queue, which it holds open itself, forever).

Every worker runs with one thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)): several ranks with
several threads each on two cores run an order of magnitude slower.

Workers are forked from multiprocessing's fork server, which imports torch and the training stack once per
session: a spawned worker would import them itself, seconds per rank (an 8-rank world took ~28 s to start and
import the test helpers, a forked one ~2 s). The server only imports (with OMP_NUM_THREADS=1, which starts no
thread pool), so it forks from a single thread and no process group. A worker freezes what it inherited
(gc.freeze): every training run collects garbage twice (lifecycle.shutdown), and a collection that traverses
the ~300k objects of the imported modules took 0.16 s per rank.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback

DEFAULT_TIMEOUT_S = 300
# What the fork server imports before it forks workers: only modules this test process has already imported, so
# a module that fails to import fails here, in the test, with its traceback, rather than in the server.
_PRELOAD = ("torch", "torch.distributed", "megatron_lite.training.loop", "megatron_lite.checkpoint.planner",
            "pretrain_gpt")


def process_context():
    """The multiprocessing context of test workers: forked from a server that has imported torch and the
    training stack (where this process has), instead of each worker importing them."""
    import megatron_lite.checkpoint.planner  # noqa: F401 - the checkpoints' DCP planners, which training imports lazily

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([name for name in _PRELOAD if name in sys.modules])
    return context


def _worker(rank: int, size: int, init_file: str, tasks, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gc.freeze()  # the modules imported so far live as long as the worker: collections need not traverse them
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    test_process = multiprocessing.parent_process()
    while True:
        try:
            task = tasks.get(timeout=5)
        except queue.Empty:
            if test_process.is_alive():
                continue
            return  # the test process was killed: no task, nor the shutdown, will come
        if task is None:
            break
        _destroy_subgroups(dist)
        gc.freeze()  # what earlier tasks left (test modules, the libraries they imported) lives on: skip it too
        fn, args = pickle.loads(task)
        try:
            results.put((rank, "ok", pickle.dumps(fn(*args))))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test process
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


def _destroy_subgroups(dist) -> None:
    """Destroy the groups earlier tasks created (torch registers every group in `_world.pg_map`): gloo keeps
    three threads per group, and a world that runs hundreds of tasks would otherwise hold thousands. A new
    task arrives only once every rank has returned the previous one, so no rank still uses them."""
    world = dist.group.WORLD
    for group in [g for g in dist.distributed_c10d._world.pg_map if g is not world]:
        dist.destroy_process_group(group)
    gc.collect()


class World:
    """N spawned processes in one gloo process group, waiting for functions to run."""

    def __init__(self, size: int):
        self.size = size
        context = process_context()
        self._dir = tempfile.TemporaryDirectory(prefix="gloo_world_")
        init_file = os.path.join(self._dir.name, "init")
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(size)]
        self.processes = [context.Process(target=_worker, args=(rank, size, init_file, self.tasks[rank],
                                                                 self.results), daemon=True)
                          for rank in range(size)]
        for process in self.processes:
            process.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
        task = pickle.dumps((fn, args))
        for q in self.tasks:
            q.put(task)
        outputs: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(outputs) < self.size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, payload = self.results.get(timeout=max(min(remaining, 5.0), 0.01))
            except queue.Empty:
                if remaining <= 0:
                    self.close()
                    raise TimeoutError(f"{fn.__name__} did not finish on {self.size} ranks within {timeout}s "
                                       f"(finished: {sorted(outputs)})") from None
                if not self.alive:
                    self.close()
                    raise RuntimeError(f"a rank died while running {fn.__name__}") from None
                continue
            if status == "error":
                self.close()
                raise AssertionError(f"rank {rank} failed in {fn.__name__}:\n{payload}")
            outputs[rank] = pickle.loads(payload)
        return [outputs[rank] for rank in range(self.size)]

    def close(self) -> None:
        for q in self.tasks:
            with contextlib.suppress(ValueError, OSError):
                q.put(None)
        for process in self.processes:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
        self._dir.cleanup()


_WORLDS: dict[int, World] = {}


def run_on_ranks(size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT_S) -> list:
    """Run `fn(*args)` on every rank of a (reused) `size`-rank gloo world; results in rank order."""
    world = _WORLDS.get(size)
    if world is None or not world.alive:
        world = _WORLDS[size] = World(size)
    try:
        return world.run(fn, *args, timeout=timeout)
    except BaseException:
        _WORLDS.pop(size, None)
        raise


def close_all_worlds() -> None:
    for world in _WORLDS.values():
        world.close()
    _WORLDS.clear()


# ---------------------------------------------------------------------------------------------------
# The entry point on N forked ranks, as torchrun would start it

class EntryRun:
    """What one rank of `run_entry_on_ranks` returned and printed."""

    def __init__(self, code: int, stdout: str, stderr: str):
        self.code, self.stdout, self.stderr = code, stdout, stderr


def _entry_rank(rank: int, size: int, port: int, entry: str, argv: list[str], env: dict, out: str, err: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(size),
                       "LOCAL_WORLD_SIZE": str(size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **env})
    with open(out, "w") as stdout, open(err, "w") as stderr:
        os.dup2(stdout.fileno(), 1)
        os.dup2(stderr.fileno(), 2)
    code = 1
    try:
        code = importlib.import_module(entry).main(argv) or 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - a traceback is what the test reads
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_entry_on_ranks(size: int, argv: list[str], env: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                       entry: str = "pretrain_gpt") -> list[EntryRun]:
    """`entry`.main(argv) (pretrain_gpt.py's, or a test's variant of it) on `size` processes forked from the test
    server (torch and the training stack already imported), each with the variables torchrun gives its workers
    (the store on rank 0, at a free port), for tests whose subject is what the ranks do and print, not torchrun
    itself; the ranks' results in rank order. Ranks still running at the timeout are killed and the test fails."""
    import pretrain_gpt  # noqa: F401 - imported here, the server that forks the ranks imports it once
    from tests.launching import free_port

    context, port = process_context(), free_port()
    with tempfile.TemporaryDirectory(prefix="entry_") as folder:
        outputs = [(os.path.join(folder, f"{rank}.out"), os.path.join(folder, f"{rank}.err")) for rank in range(size)]
        processes = [context.Process(target=_entry_rank, args=(rank, size, port, entry, argv, env or {},
                                                               *outputs[rank])) for rank in range(size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(deadline - time.monotonic(), 0.1))
        stuck = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        runs = []
        for process, (out, err) in zip(processes, outputs):
            with open(out) as stdout, open(err) as stderr:
                runs.append(EntryRun(process.exitcode, stdout.read(), stderr.read()))
    if stuck:
        raise TimeoutError(f"ranks {stuck} of pretrain_gpt.py {' '.join(argv)} still ran after {timeout} s:\n"
                           + "\n".join(run.stderr[-2000:] for run in runs))
    return runs
