"""Re-running a suspicious iteration to tell a fault of the machine from a property of the data (Megatron's
--rerun-mode, --check-for-spiky-loss, --check-for-large-grads, --result-rejected-tracker-filename).

An iteration's result is suspicious when one of its losses or its gradient norm is unexpectedly large
(Megatron's `is_unexpectedly_large`: at least 10 times the largest of the first 100 values seen), or, with
--check-for-nan-in-loss-and-grad, not finite. The losses judged are every one that enters the backward: the LM
loss, each multi-token prediction depth's, and the MoE auxiliary and z-losses. Under --rerun-mode
validate_results the iteration is then run again before its step is applied, on the same micro-batches
(replayed), from the same random generator states and the same MoE statistics:

- the same result again (to the bit, Megatron's tolerance 0) comes from the data or the model: it is
  recorded in the tracker file and training continues with it (a non-finite one still stops the run, as
  --check-for-nan-in-loss-and-grad says);
- a different result is a transient fault of the machine: the ranks whose own contribution changed (their
  micro-batches' loss, their gradients before the data-parallel reduction) are named with their hosts, and
  the run stops with Megatron's exit status 17, nothing of the iteration applied or saved, so that the job
  restarts from its last checkpoint. With --overlap-grad-reduce or ZeRO-2/3 the gradients are reduced during
  backward, so a gradient fault shows on every rank of its data-parallel group and only the group is named.

The losses and gradient norm judged are the global ones, equal on every rank, so every rank decides alike
without a collective; the fingerprints that name the faulty ranks are gathered only when a rerun differs.
`--rerun-mode disabled` only records (and warns of) suspicious results; `report_stats` runs every iteration
twice and reports the largest relative difference between the two runs at each log interval (a measure of
the run's nondeterminism). The running statistics start afresh when a run resumes.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
from dataclasses import dataclass, field

import torch

from megatron_lite.checkpoint.agreement import all_gather
from megatron_lite.checkpoint.rng_state import rng_states, set_rng_states
from megatron_lite.config.sections import Config
from megatron_lite.errors import TrainingDivergedError, UserError

SPIKE_FACTOR = 10.0  # Megatron's SPIKY_LOSS_FACTOR and the large-gradient threshold
STATISTICS_SAMPLES = 100  # values seen before a result can be judged unexpectedly large
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17  # Megatron's status for a run stopped by a transient fault


class TransientFaultError(UserError, RuntimeError):
    """A rerun of an iteration gave another result than its first run: the machine, not the data."""

    exit_code = EXIT_CODE_FAILED_ON_RESULT_VALIDATION


class ReplayableIterator:
    """A data iterator that can hand out the items of the current iteration again (Megatron's
    RerunDataIterator): `mark()` starts an iteration, `rewind()` replays what was taken since."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.taken: list = []
        self.replay: list = []

    def __iter__(self):
        return self

    def __next__(self):
        item = self.replay.pop(0) if self.replay else next(self.iterator)
        self.taken.append(item)
        return item

    def mark(self) -> None:
        """Start an iteration: what is taken from here on can be replayed (after items rewound and not yet
        taken again, which come first)."""
        self.taken = []

    def rewind(self) -> None:
        self.replay, self.taken = self.taken, []


@dataclass
class Result:
    """What one run of an iteration gave: the global values judged, and this rank's own contribution."""

    lm_loss: float
    grad_norm: float
    fingerprint: torch.Tensor  # [2]: this rank's loss sum and gradient sum of squares, before reduction
    other_losses: dict[str, float] = field(default_factory=dict)  # "mtp 1 loss", "moe aux loss", ...

    @property
    def losses(self) -> dict[str, float]:
        """Every loss that entered the backward, by name."""
        return {"lm loss": self.lm_loss, **self.other_losses}

    def same_as(self, other: Result) -> bool:
        mine, theirs = self.losses, other.losses
        return (mine.keys() == theirs.keys() and all(_same(mine[name], theirs[name]) for name in mine)
                and _same(self.grad_norm, other.grad_norm))


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _relative_difference(a: float, b: float) -> float:
    if _same(a, b):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b)) if math.isfinite(a) and math.isfinite(b) else math.inf


class RerunStateMachine:
    """Decides after each run of an iteration whether to run it again, and what a rerun means."""

    def __init__(self, config: Config, rank: int, group=None, mode: str | None = None):
        t = config.training
        self.mode = mode or t.rerun_mode
        self.check_spiky_loss, self.check_large_grads = t.check_for_spiky_loss, t.check_for_large_grads
        self.check_non_finite = config.optimizer.check_for_nan_in_loss_and_grad
        self.fp16 = config.optimizer.fp16  # a non-finite gradient norm is then an overflow the loss scaler skips
        self.tracker = t.result_rejected_tracker_filename
        self.rank, self.group = rank, group
        self.largest: dict[str, float] = {}
        self.seen: dict[str, int] = {}
        self.stats_difference = 0.0  # report_stats: the largest relative difference since the last read
        self.first: Result | None = None  # the first run's result while its rerun runs
        self.suspicion: str | None = None  # why the first run was rerun
        self.saved = None

    @property
    def names_faulty_ranks(self) -> bool:
        """Whether each run needs this rank's fingerprint (rank_fingerprint), to name the ranks of a fault."""
        return self.mode == "validate_results"

    # ------------------------------------------------------------------------------------------------
    # The state an iteration starts from

    def start_iteration(self, model: list, device: torch.device, data_iterator, replayable: bool = False) -> None:
        """Remember what a rerun must start from (only when a rerun can happen, or `replayable`: when the
        iteration may have to run again for another reason, see `replay`)."""
        self.first = None
        if self.mode == "disabled" and not replayable:
            return
        if isinstance(data_iterator, ReplayableIterator):
            data_iterator.mark()
        self.saved = ({name: state.clone() for name, state in rng_states(model, device).items()},
                      model[0].training_hooks().statistics(model))

    def replay(self, model: list, device: torch.device, data_iterator) -> None:
        """Make the next run of the iteration start where this one started: its data, generators and MoE
        statistics (an iteration a replica group did not commit, training/fault_tolerance.py)."""
        self._rewind(model, device, data_iterator)

    def _rewind(self, model: list, device: torch.device, data_iterator) -> None:
        states, statistics = self.saved
        set_rng_states(model, device, states)
        model[0].training_hooks().load_statistics(model, statistics)
        if isinstance(data_iterator, ReplayableIterator):
            data_iterator.rewind()

    # ------------------------------------------------------------------------------------------------
    # Judging a result

    def should_rerun(self, result: Result, iteration: int, model: list, device: torch.device,
                     data_iterator) -> bool:
        """After a run of iteration `iteration` (0-based): True to run it again (the state is rewound);
        False to go on with `result`. Raises when the result stops the run."""
        if self.first is None:
            suspicion = self._suspicion(result)
            if self.mode == "report_stats" or (suspicion and self.mode == "validate_results"):
                self.first = result
                self.suspicion = suspicion
                if suspicion:
                    self._record(iteration, "initial_run", result, suspicion)
                self._rewind(model, device, data_iterator)
                return True
            if suspicion:
                self._record(iteration, "rerun_disabled", result, suspicion)
                self._raise_if_non_finite(iteration, result)
                self._warn(f"iteration {iteration + 1}: {suspicion} (--rerun-mode disabled: not rerun)")
            return False
        first, self.first = self.first, None
        if self.mode == "report_stats":
            self.stats_difference = max(self.stats_difference, _relative_difference(first.lm_loss, result.lm_loss),
                                        _relative_difference(first.grad_norm, result.grad_norm))
            return False
        if result.same_as(first):
            self._record(iteration, "first_rerun_reproducible", result, self.suspicion)
            self._warn(f"iteration {iteration + 1}: {self.suspicion}, the same when rerun: it comes from the data "
                       f"or the model, not the machine; recorded{self._in_tracker()}")
            self._raise_if_non_finite(iteration, result)
            return False
        self._stop_on_transient_fault(iteration, first, result)
        return False  # not reached

    def _suspicion(self, result: Result) -> str | None:
        """Why `result` needs a second look, or None."""
        if self.check_non_finite:
            for context, value in self._judged_finite(result):
                if not math.isfinite(value):
                    return f"{context} is {value}"
        checked = ({**result.losses} if self.check_spiky_loss else {}) | (
            {"grad norm": result.grad_norm} if self.check_large_grads else {})
        found = None
        for context, value in checked.items():  # every value updates its statistics
            if self._unexpectedly_large(context, value) and found is None:
                found = (f"{context} {value:.6g} is at least {SPIKE_FACTOR:g} x the largest of the first "
                         f"{STATISTICS_SAMPLES} ({self.largest[context]:.6g})")
        return found

    def _unexpectedly_large(self, context: str, value: float) -> bool:
        """Megatron's is_unexpectedly_large: the largest of the first STATISTICS_SAMPLES finite values is the
        reference; a later value of at least SPIKE_FACTOR times it is unexpected."""
        value = abs(value)
        if not math.isfinite(value):
            return False
        if self.seen.get(context, 0) < STATISTICS_SAMPLES:
            self.seen[context] = self.seen.get(context, 0) + 1
            self.largest[context] = max(self.largest.get(context, 0.0), value)
            return False
        return value >= SPIKE_FACTOR * self.largest[context]

    def _judged_finite(self, result: Result) -> list[tuple[str, float]]:
        """The values --check-for-nan-in-loss-and-grad requires finite."""
        return list(result.losses.items()) + ([] if self.fp16 else [("grad norm", result.grad_norm)])

    def _raise_if_non_finite(self, iteration: int, result: Result) -> None:
        if not self.check_non_finite:
            return
        for which, value in self._judged_finite(result):
            if not math.isfinite(value):
                raise TrainingDivergedError(
                    f"iteration {iteration + 1}: {which} is {value}; the step was not applied and nothing after "
                    f"iteration {iteration} was saved (lower --lr, raise --clip-grad or resume from the last "
                    f"checkpoint; --no-check-for-nan-in-loss-and-grad trains on)")

    def _stop_on_transient_fault(self, iteration: int, first: Result, rerun: Result) -> None:
        """Name the ranks whose own contribution changed between the runs, record them, and stop."""
        host = socket.gethostname()
        changed = not torch.equal(first.fingerprint, rerun.fingerprint)
        everyone = all_gather((self.rank, host, changed), self.group)
        faulty = [f"rank {rank} on {where}" for rank, where, differs in everyone if differs]
        if self.rank == 0:
            for rank, where, differs in everyone:
                if differs:
                    self._record(iteration, "first_rerun_not_reproducible", rerun, self.suspicion, rank, where)
        who = ", ".join(faulty) if faulty else (
            "no rank's own contribution changed, so the fault lies in the communication between them")
        raise TransientFaultError(
            f"iteration {iteration + 1}: {self.suspicion}; rerun on the same data it gave lm loss {rerun.lm_loss:.6g}, "
            f"grad norm {rerun.grad_norm:.6g} (first run: {first.lm_loss:.6g}, {first.grad_norm:.6g}): a transient "
            f"fault of the machine ({who}); the step was not applied: restart from the last checkpoint, "
            f"preferably on other hosts")

    # ------------------------------------------------------------------------------------------------
    # Reporting

    def read_stats(self) -> dict:
        """report_stats: the largest relative difference between an iteration's two runs since the last read."""
        if self.mode != "report_stats":
            return {}
        difference, self.stats_difference = self.stats_difference, 0.0
        return {"rerun_max_relative_difference": difference}

    def _in_tracker(self) -> str:
        return f" in {self.tracker}" if self.tracker else ""

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            print(f"warning: {message}", flush=True)

    def _record(self, iteration: int, status: str, result: Result, message: str, rank: int | None = None,
                host: str | None = None) -> None:
        """One line of Megatron's tracker format, written by rank 0 (the values judged are global)."""
        if not self.tracker or self.rank != 0:
            return
        line = (f"ts={datetime.datetime.now()} node={host or socket.gethostname()} device={_device_index()} "
                f"jobID={os.environ.get('SLURM_JOBID', 'N/A')} rank={self.rank if rank is None else rank} "
                f"iteration={iteration + 1} status={status} result=(lm_loss={result.lm_loss!r}, "
                f"grad_norm={result.grad_norm!r}) message='{message}'\n")
        with open(self.tracker, "a") as f:
            f.write(line)


def _device_index() -> int:
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def rank_fingerprint(reports: list[dict], model: list, device: torch.device) -> torch.Tensor:
    """[2] on `device`: this rank's loss sum over its micro-batches and the sum of squares of its gradient
    buffers as they are before the data-parallel reduction finishes."""
    loss = sum((report["lm loss"][0].double() for report in reports), torch.zeros((), dtype=torch.float64,
                                                                                     device=device))
    squares = sum((chunk.grad_buffer_square_sum().double() for chunk in model),
                  torch.zeros((), dtype=torch.float64, device=device))
    return torch.stack([loss.to(device), squares.to(device)])
