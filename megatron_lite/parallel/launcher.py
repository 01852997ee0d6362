"""What a training process takes from its launcher (torchrun or srun): its rank, and the end of its life.

Rank and world. torchrun gives every worker RANK, WORLD_SIZE and LOCAL_RANK (with MASTER_ADDR and
MASTER_PORT); `srun` with one task per GPU gives SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID instead.
`adopt_slurm_environment` copies SLURM's values under torchrun's names, so everything after it (the error
lines, the process group's store, the choice of GPU) reads one set of variables. torchrun's restarts need
one more variable, set for torchrun itself: `warn_of_restart_hazard` names it when it is missing.

The end of its life. torchrun starts each worker in a session of its own, so when the launcher is killed
(kill -9 of torchrun, a node's job step torn down) nothing stops the workers: they train on as orphans and
keep saving into --save, racing the run that replaces them. `exit_with_launcher` ends a worker within
POLL_SECONDS of its launcher's death. It polls the parent's pid from a daemon thread rather than asking Linux for
a parent-death signal (prctl PR_SET_PDEATHSIG): that signal fires when the *thread* that started the worker
exits, even if the launcher lives on, and its natural choice, SIGTERM, is the signal --exit-signal-handler
turns into "save a checkpoint, then exit", the very thing an orphan must not do.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import MutableMapping

from megatron_lite.errors import UserError, report

_SLURM_TO_TORCHRUN = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}
POLL_SECONDS = 0.5


class LauncherError(UserError):
    """The launcher's environment does not describe a complete process group."""


def adopt_slurm_environment(environ: MutableMapping[str, str]) -> bool:
    """Under `srun` with one task per GPU, set RANK, WORLD_SIZE and LOCAL_RANK from SLURM's variables;
    returns whether it did. torchrun's variables, when present (torchrun inside an srun task), win."""
    if "RANK" in environ or not all(name in environ for name in _SLURM_TO_TORCHRUN):
        return False
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing and int(environ["SLURM_NTASKS"]) > 1:
        raise LauncherError(
            f"started by srun with {environ['SLURM_NTASKS']} tasks but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: export MASTER_ADDR=$(scontrol show hostnames "
            f"\"$SLURM_JOB_NODELIST\" | head -n 1) and MASTER_PORT=29500 before srun")
    for slurm_name, torchrun_name in _SLURM_TO_TORCHRUN.items():
        environ[torchrun_name] = environ[slurm_name]
    return True


def warn_of_restart_hazard(environ: MutableMapping[str, str]) -> str | None:
    """Rank 0 warns (and returns the warning) when torchrun may restart the group (--max-restarts) while its
    workers share the rendezvous store of its agent: a restarted group finds the previous group's addresses
    there and fails to connect (pytorch/pytorch#135712), so the restart fails too."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) < 1:
        return None
    warning = ("warning: a group restarted by torchrun --max-restarts cannot connect while the workers share the "
               "agent's store (pytorch/pytorch#135712): export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun "
               "(with --rdzv-backend c10d)")
    if environ.get("RANK") == "0":
        print(warning, file=sys.stderr, flush=True)
    return warning


def launched_by_a_launcher(environ: MutableMapping[str, str]) -> bool:
    """Whether torchrun or a SLURM job step (srun) started this process: then its parent's death should end
    it; a plain `python pretrain_gpt.py` (under nohup, say) outlives its shell as the user intended."""
    return "TORCHELASTIC_RUN_ID" in environ or "SLURM_STEP_ID" in environ


def exit_with_launcher(environ: MutableMapping[str, str]) -> threading.Thread | None:
    """When launched by torchrun or srun, start a daemon thread that ends this process (exit status 1, one
    `error (rank R)` line) within POLL_SECONDS of its parent's death; returns the thread, or None."""
    if not launched_by_a_launcher(environ):
        return None
    watchdog = threading.Thread(target=_watch_parent, args=(os.getppid(),), name="launcher-watchdog", daemon=True)
    watchdog.start()
    return watchdog


def _watch_parent(parent: int) -> None:
    """A dead parent's children are re-parented (to init or a subreaper), so the parent's pid changes."""
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    with contextlib.suppress(OSError, ValueError):  # stderr may have been a pipe to the dead launcher
        report(LauncherError(f"the launcher (pid {parent}) is gone; this worker stops instead of training and "
                             f"saving checkpoints on its own"))
    os._exit(1)  # now, from this thread: no cleanup that could wait on ranks that are gone
