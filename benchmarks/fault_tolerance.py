"""What losing a data-parallel replica costs: torchft replica groups against a checkpoint restart of the same run.

Replica groups (--fault-tolerance torchft): two groups of the tiny model (one process each) with torchft's
lighthouse; group 1 is killed with SIGKILL (its torchrun and worker) once both train together; measured: from the
kill to group 0's next committed step (the survivors' stall), and from launching group 1 again to its first
committed step (start-up, quorum and the state taken from its peer). Group 0 never stops.

Checkpoint restart: the same samples as one torchrun of two processes at twice the batch, saving every
--save-interval steps; the whole job is killed at the same step and relaunched with --load; measured: from the
relaunch to its first step, and the steps it trains again (those since the last checkpoint) with the time they
take, until it is back at the step where it died.

Times come from polling the metrics JSONL files every 10 ms, on this machine's CPUs beside the other processes of
the run; each run is stopped once measured. Appends the figures with date, machine and command to
benchmarks/results/fault_tolerance.jsonl.

    python -m benchmarks.fault_tolerance [--kill-at 40] [--save-interval 25]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_file import record_result
from tests.replica_groups import group_flags, kill_tree, killed_at_exit, lighthouse, records, torchrun, wait_for


def _replica_groups(root: Path, iters: int, kill_at: int) -> dict:
    beacon, address = lighthouse(min_replicas=1)
    with killed_at_exit(beacon) as launched:
        group0 = torchrun(1, group_flags(0, address, root, iters), root / "group0.log")
        group1 = torchrun(1, group_flags(1, address, root, iters), root / "group1.log")
        launched += [group0, group1]
        wait_for(lambda: any(r["iteration"] >= kill_at and r["ft_participants"] == 2
                             for r in records(root / "group1.jsonl")), 300, "the kill step")
        kill_tree(group1)
        killed = time.monotonic()
        seen = len(records(root / "group0.jsonl"))
        wait_for(lambda: len(records(root / "group0.jsonl")) > seen, 300, "group 0's next step")
        stall = time.monotonic() - killed
        relaunched = time.monotonic()
        launched.append(torchrun(1, group_flags(1, address, root, iters, run="_restart"), root / "group1_restart.log"))
        rejoined_at = wait_for(lambda: records(root / "group1_restart.jsonl"), 300, "group 1's rejoining")[0]
        rejoin = time.monotonic() - relaunched
        survivor_alive = group0.poll() is None
    return {"survivors_stall_s": round(stall, 3), "restart_to_rejoin_s": round(rejoin, 3),
            "rejoined_at_iteration": rejoined_at["iteration"], "rejoined_with_participants":
            rejoined_at["ft_participants"], "survivor_never_stopped": survivor_alive}


def _checkpoint_restart(root: Path, iters: int, kill_at: int, save_interval: int) -> dict:
    flags = ["--global-batch-size", "4", "--train-iters", str(iters), "--log-interval", "1",
             "--save", str(root / "ckpt"), "--save-interval", str(save_interval)]
    with killed_at_exit(torchrun(2, [*flags, "--metrics-jsonl", str(root / "job.jsonl")], root / "job.log")) as job:
        wait_for(lambda: any(r["iteration"] >= kill_at for r in records(root / "job.jsonl")), 300, "the kill step")
        kill_tree(job[0])
    died_at = records(root / "job.jsonl")[-1]["iteration"]
    relaunched = time.monotonic()
    with killed_at_exit(torchrun(2, [*flags, "--load", str(root / "ckpt"), "--metrics-jsonl",
                                     str(root / "again.jsonl")], root / "again.log")):
        first = wait_for(lambda: records(root / "again.jsonl"), 300, "the first step after the restart")[0]
        first_step = time.monotonic() - relaunched
        wait_for(lambda: any(r["iteration"] >= died_at for r in records(root / "again.jsonl")), 300,
                 "the step it died at")
        caught_up = time.monotonic() - relaunched
    return {"relaunch_to_first_step_s": round(first_step, 3), "relaunch_to_step_of_death_s": round(caught_up, 3),
            "steps_trained_again": died_at - (first["iteration"] - 1)}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kill-at", type=int, default=40, help="the step at which the replica (or job) is killed")
    parser.add_argument("--save-interval", type=int, default=25, help="the checkpoint restart's --save-interval")
    parser.add_argument("--iters", type=int, default=100000, help="--train-iters (the runs are stopped once measured)")
    args = parser.parse_args(argv[1:])
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "ft").mkdir()
        (Path(folder) / "ckpt").mkdir()
        groups = _replica_groups(Path(folder) / "ft", args.iters, args.kill_at)
        restart = _checkpoint_restart(Path(folder) / "ckpt", args.iters, args.kill_at, args.save_interval)
    figures = {"replica_groups": groups, "checkpoint_restart": restart, "kill_at": args.kill_at,
               "save_interval": args.save_interval, "model": "llama-tiny 2 layers, hidden 64, seq 32, CPU"}
    print(f"replica groups: survivors' next step {groups['survivors_stall_s']} s after the kill; the restarted "
          f"group rejoined {groups['restart_to_rejoin_s']} s after its launch (at iteration "
          f"{groups['rejoined_at_iteration']}, {groups['rejoined_with_participants']} participants); the survivor "
          f"{'never stopped' if groups['survivor_never_stopped'] else 'stopped'}")
    print(f"checkpoint restart: first step {restart['relaunch_to_first_step_s']} s after the relaunch, back at the "
          f"step of death after {restart['relaunch_to_step_of_death_s']} s ({restart['steps_trained_again']} steps "
          f"trained again)")
    record_result("fault_tolerance", figures, argv)


if __name__ == "__main__":
    main(sys.argv)
