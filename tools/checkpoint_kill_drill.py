"""Fault-tolerance drill: kill -9 a training rank at a random moment, restart, repeat; then SIGTERM one rank.

    python tools/checkpoint_kill_drill.py --rounds 10 --nproc 2 --dir /tmp/kill_drill

Each round starts `--nproc` ranks of pretrain_gpt.py (a tiny model on mock data, --save and --load the same
directory, a save every iteration so that kills often land inside a save, --async-save every other round),
waits until training runs, sleeps a random time, SIGKILLs one random rank and then the others (a
scheduler does the same once one rank is gone). Checked after every round:
  - every complete checkpoint in the directory loads, tensor by tensor (zero unloadable checkpoints);
  - the next run resumes from the newest complete checkpoint.
The last round sends SIGTERM to one rank under --exit-signal-handler: every rank must save and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_lite.checkpoint import directory  # noqa: E402
from megatron_lite.tool_args import ToolParser, non_negative_int, positive_int, seed  # noqa: E402

MODEL_FLAGS = ["--model-preset", "llama-tiny", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
               "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32",
               "--max-position-embeddings", "32", "--vocab-size", "1000", "--mock-data", "--micro-batch-size", "2",
               "--train-iters", "100000", "--lr", "1e-3", "--eval-interval", "1000000", "--log-interval", "1",
               "--device", "cpu"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, root: str, log_dir: str, extra: list[str]) -> list[tuple[subprocess.Popen, str]]:
    """Start the ranks of one run as torchrun would (env:// rendezvous), each logging to a file."""
    port = _free_port()
    ranks = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        log = os.path.join(log_dir, f"rank{rank}.log")
        with open(log, "w") as out:
            process = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *MODEL_FLAGS,
                                        "--global-batch-size", str(2 * nproc), "--save", root, "--load", root,
                                        "--save-interval", "1", "--keep-last-n", "3", *extra],
                                       env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        ranks.append((process, log))
    return ranks


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def wait_for_training(ranks, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while " iteration " not in _read(ranks[-1][1]):
        if time.monotonic() > deadline or any(p.poll() is not None for p, _ in ranks):
            raise RuntimeError("training did not start:\n" + _read(ranks[0][1])[-3000:])
        time.sleep(0.05)


def resumed_iteration(log: str) -> int:
    match = re.search(r"loaded checkpoint \S+ \(saved in layout \S+\) at iteration (\d+)", _read(log))
    return int(match.group(1)) if match else 0


def check_loadable(root: str) -> int:
    """Load every tensor of every complete checkpoint; returns how many there are. Raises on any failure."""
    from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors  # torch: once the flags are read

    iterations = directory.complete_iterations(root)
    for iteration in iterations:
        tensors = read_checkpoint_tensors(directory.checkpoint_path(root, iteration))
        if not tensors or "decoder.layers.0.mlp.linear_fc1.weight" not in tensors:
            raise RuntimeError(f"checkpoint {iteration} is missing tensors")
    return len(iterations)


def saves_in_progress(root: str) -> set[tuple[str, int]]:
    """Temporary directories of unfinished saves, with their inode (a later save may reuse a name)."""
    found = set()
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):  # committed (renamed) meanwhile
                found.add((name, os.stat(os.path.join(root, name)).st_ino))
    return found


def kill_round(nproc: int, root: str, log_dir: str, rng: random.Random, async_save: bool) -> dict:
    newest_before = directory.latest_iteration(root) or 0
    leftovers = saves_in_progress(root)
    ranks = launch(nproc, root, log_dir, ["--async-save"] if async_save else [])
    wait_for_training(ranks)
    time.sleep(rng.uniform(0.0, 1.5))
    victim = rng.randrange(nproc)
    ranks[victim][0].send_signal(signal.SIGKILL)
    in_save = bool(saves_in_progress(root) - leftovers)
    time.sleep(0.3)
    for process, _ in ranks:  # the survivors wait in a collective forever: the scheduler kills them
        if process.poll() is None:
            process.kill()
        process.wait()
    resumed = resumed_iteration(ranks[0][1])
    if resumed != newest_before:
        raise RuntimeError(f"run resumed from iteration {resumed}, newest complete checkpoint was {newest_before}")
    return {"victim": victim, "killed_during_save": in_save, "resumed_from": resumed,
            "newest_after": directory.latest_iteration(root) or 0, "loadable": check_loadable(root)}


def sigterm_round(nproc: int, root: str, log_dir: str, rng: random.Random) -> dict:
    ranks = launch(nproc, root, log_dir, ["--exit-signal-handler"])
    wait_for_training(ranks)
    time.sleep(rng.uniform(0.0, 1.0))
    ranks[rng.randrange(nproc)][0].send_signal(signal.SIGTERM)
    codes = [process.wait(timeout=120) for process, _ in ranks]
    match = re.search(r"exiting at iteration (\d+): exit signal received", _read(ranks[0][1]))
    if codes != [0] * nproc or match is None:
        raise RuntimeError(f"SIGTERM run ended with exit codes {codes}:\n" + _read(ranks[0][1])[-3000:])
    if directory.latest_iteration(root) != int(match.group(1)):
        raise RuntimeError(f"no checkpoint at the exit iteration {match.group(1)}")
    return {"exit_codes": codes, "exit_iteration": int(match.group(1)), "loadable": check_loadable(root)}


def prepare_drill_directory(parser: ToolParser, path: str) -> tuple[str, str]:
    """(checkpoints, logs) under `path`, emptied; `path` must be new, empty, or an earlier drill's directory
    (holding nothing but checkpoints/ and logs/), so that a mistyped --dir never deletes anything else."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"--dir {path} is a file; give a directory for the drill")
    others = sorted(set(os.listdir(path)) - {"checkpoints", "logs"}) if os.path.isdir(path) else []
    if others:
        parser.error(f"--dir {path} holds {', '.join(others[:3])}{' ...' * (len(others) > 3)}, which are not a "
                     f"drill's; give a new or empty directory (the drill empties it)")
    root, log_dir = os.path.join(path, "checkpoints"), os.path.join(path, "logs")
    try:
        for folder in (root, log_dir):
            shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(log_dir)
    except OSError as error:
        parser.exit(1, f"checkpoint_kill_drill.py: error: cannot make {error.filename}: {error.strerror}\n")
    return root, log_dir


def main(argv=None) -> dict:
    parser = ToolParser(prog="checkpoint_kill_drill.py", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=non_negative_int, default=10, help="kill -9 rounds (default: 10)")
    parser.add_argument("--nproc", type=positive_int, default=2, help="ranks per run (default: 2)")
    parser.add_argument("--dir", default="/tmp/checkpoint_kill_drill",
                        help="the drill's directory (emptied first; new, empty or an earlier drill's)")
    parser.add_argument("--seed", type=seed, default=0, help="where the random kill moments come from")
    args = parser.parse_args(argv)
    root, log_dir = prepare_drill_directory(parser, args.dir)
    rng = random.Random(args.seed)
    rounds = []
    for number in range(args.rounds):
        result = kill_round(args.nproc, root, log_dir, rng, async_save=number % 2 == 1)
        rounds.append(result)
        print(f"round {number + 1}: killed rank {result['victim']}"
              f"{' during a save' if result['killed_during_save'] else ''}; resumed from {result['resumed_from']}, "
              f"newest complete now {result['newest_after']}, {result['loadable']} checkpoints all loadable",
              flush=True)
    graceful = sigterm_round(args.nproc, root, log_dir, rng)
    print(f"SIGTERM: every rank saved at iteration {graceful['exit_iteration']} and exited 0", flush=True)
    summary = {"rounds": len(rounds), "killed_during_save": sum(r["killed_during_save"] for r in rounds),
               "unloadable_checkpoints": 0, "final_iteration": graceful["exit_iteration"]}
    print(f"{summary['rounds']} kill -9 rounds ({summary['killed_during_save']} during a save): "
          f"0 unloadable checkpoints; each restart resumed from the newest complete one", flush=True)
    return summary


if __name__ == "__main__":
    main()
