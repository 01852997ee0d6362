"""--hang-timeout-seconds: when a rank's progress stops, every rank says where it is and the job stops.

A stuck rank otherwise leaves every other rank waiting in a collective until the process-group timeout
(--distributed-timeout-minutes), with no word of who. Each rank runs a watchdog thread over its progress
record (parallel/progress.py: iteration, step, last collective entered and left). When the record has not
changed for the deadline (HangDeadline: --hang-timeout-seconds, by default three times the longest iteration
seen and at least a minute), the rank writes its record and the Python stacks of its threads to stderr and
publishes the record in the launcher's store (MASTER_ADDR:MASTER_PORT), served apart from the collectives that
hang. The first rank to report gathers the records it finds there and prints one summary line: which ranks
wait in which collective, which ranks of its group never entered it, with their last step ("rank 3 never
entered it: its last step was forward of micro-batch 2 of 4"), and which ranks never reported (a frozen
process: a hung host or device, SIGSTOP). Any rank that can still run a thread may be that first one, so a
frozen rank is named whichever it is. Then every rank exits with HANG_EXIT_CODE, before the process-group
timeout, so that torchrun's restarts or the scheduler resume the job from its last checkpoint.

The watchdog is armed from the end of the first iteration (which may compile kernels for minutes without a
collective) to the end of the loop, and not during checkpoint saves (torch.distributed.checkpoint's own
collectives are not recorded) nor the in-training downstream evaluation. On CUDA, PyTorch's NCCL Flight
Recorder is armed as well (TORCH_NCCL_* variables, unless already set), so that NCCL dumps its own record of
collectives on a timeout.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback

import torch.distributed as dist

from megatron_lite.config.sections import Config
from megatron_lite.parallel import lifecycle
from megatron_lite.parallel.progress import RECORD, Progress
from megatron_lite.parallel.state import ParallelState

HANG_EXIT_CODE = 3
FLIGHT_RECORDER_ENV = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                       "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/nccl_trace_rank_"}


def arm_flight_recorder() -> None:
    """Turn on NCCL's Flight Recorder for this process (before its first NCCL group), unless the user set it."""
    for key, value in FLIGHT_RECORDER_ENV.items():
        os.environ.setdefault(key, value)


def _flight_recorder_note() -> str:
    """Where NCCL's Flight Recorder dumps on its timeout, when it is armed."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        return ""
    path = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", FLIGHT_RECORDER_ENV["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"])
    return f"NCCL Flight Recorder dumps to {path}<rank>\n"


def _store_prefix() -> str:
    """Keys of this attempt only: torchrun's agent store outlives a restart, and with it an earlier hang's keys."""
    return f"megatron_lite/hang/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def describe(snapshot: dict, rank: int, group_names: dict[int, str]) -> dict:
    """A record as JSON-ready values, its group named by the kinds it serves."""
    group = snapshot["group"]
    return {**snapshot, "rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "group": group_names.get(group, "unnamed") if group is not None else None}


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _last_step(record: dict) -> str:
    where = f"its last step was {record['step']}"
    if record["iteration"] is not None:
        where += f" of iteration {record['iteration']}"
    if record["op"] is not None:
        where += f", its last collective {record['op']} #{record['count']} over the {record['group']} group"
    return where


def hang_summary(records: dict[int, dict], world_size: int, timeout_s: float) -> str:
    """One line from the records of the ranks that reported (by global rank). Of the collectives ranks wait
    in, the one named first is a collective some rank of its group has not entered while not waiting in any
    other: that rank holds the others up (a rank waiting elsewhere is itself held up)."""
    records = dict(sorted(records.items()))  # the same line whichever rank gathered them (ties go to the lowest)
    head = f"no progress for {timeout_s:g} s (--hang-timeout-seconds)"
    silent = sorted(set(range(world_size)) - set(records))
    tail = [f"{_ranks(silent)} did not report (dead, or stopped holding the interpreter)"] if silent else []
    inside = {rank: (r["op"], r["group"], r["count"]) for rank, r in records.items() if r["inside"]}
    if not inside:
        steps = [f"rank {rank}: {_last_step(r)}" for rank, r in sorted(records.items())]
        return "; ".join([f"{head}: no rank is inside a collective", *steps, *tail])
    members = {(r["op"], r["group"], r["count"]): r["group_ranks"] for r in records.values() if r["inside"]}
    waits = collections.Counter(inside.values())

    def holds_up(key) -> bool:
        return any(rank not in inside for rank in members[key] if inside.get(rank) != key)

    key = max(waits, key=lambda k: (holds_up(k), waits[k]))
    op, group, count = key
    waiting = [rank for rank, k in inside.items() if k == key]
    verb = "is" if len(waiting) == 1 else "are"
    parts = [f"{head}: {_ranks(waiting)} of the {len(members[key])} in the {group} group {verb} in {op} #{count}"]
    for rank in sorted(set(members[key]) - set(waiting)):
        if rank in records and rank not in inside:
            parts.append(f"rank {rank} never entered it: {_last_step(records[rank])}")
    for rank, (other_op, other_group, other_count) in sorted(inside.items()):
        if (other_op, other_group, other_count) != key:
            parts.append(f"rank {rank} waits in {other_op} #{other_count} over the {other_group} group")
    return "; ".join(parts + tail)


def thread_stacks() -> str:
    """The Python stack of every thread of this process, the main thread's where it waits included."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    blocks = [f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
              for ident, frame in sys._current_frames().items()]
    return "\n".join(blocks)


class HangDeadline:
    """How long a rank may make no progress before it reports: --hang-timeout-seconds where given; by default
    STEP_FACTOR times the longest iteration seen so far, at least DEFAULT_FLOOR_S (a frozen rank is named about a
    minute after the stall) and at most half the process-group timeout (which would end the run anyway)."""

    DEFAULT_FLOOR_S = 60.0
    STEP_FACTOR = 3.0

    def __init__(self, fixed_s: float | None, cap_s: float):
        self.fixed_s, self.cap_s = fixed_s, cap_s
        self.longest_step_s = 0.0

    def saw_step(self, seconds: float) -> None:
        self.longest_step_s = max(self.longest_step_s, seconds)

    def seconds(self) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        return min(max(self.DEFAULT_FLOOR_S, self.STEP_FACTOR * self.longest_step_s), self.cap_s)


class HangWatchdog:
    """The watchdog thread of one rank; `arm`/`disarm` say when a stopped record counts as a hang, `step_done`
    arms it and tells the deadline how long the iteration took."""

    def __init__(self, deadline: HangDeadline, rank: int, world_size: int, group_names: dict[int, str], store,
                 record: Progress = RECORD, exit_process=os._exit):
        self.deadline, self.rank, self.world_size = deadline, rank, world_size
        self.group_names, self.record, self.exit_process = group_names, record, exit_process
        self.store = dist.PrefixStore(_store_prefix(), store) if store is not None else None
        self.armed = False
        self._armed_at: float | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        self.record.set_step(self.record.step)  # the deadline counts from now
        self._armed_at = time.monotonic()
        self.armed = True

    def step_done(self) -> None:
        """An iteration ended: the time since the watchdog was last armed (this iteration, and any evaluation
        after the one before) counts as a step's; the first iteration, which may compile for minutes, ends
        before the watchdog is first armed and is not counted."""
        if self.armed and self._armed_at is not None:
            self.deadline.saw_step(time.monotonic() - self._armed_at)
        self.arm()

    def disarm(self) -> None:
        self.armed = False

    def close(self) -> None:
        self.armed = False
        self._closed.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.deadline.seconds() / 10)):
            if self.armed and self.record.idle_seconds() > self.deadline.seconds():
                self.report()
                self.exit_process(HANG_EXIT_CODE)
                return

    def report(self) -> str | None:
        """Write this rank's record and stacks and publish the record. The first rank to report (any rank still
        able to run this thread: a frozen one never reports) gathers the records and prints the summary
        (returned); the others wait for it, so that no rank's exit ends the job before it is printed."""
        timeout_s = self.deadline.seconds()
        grace = min(max(10.0, timeout_s / 4), 30.0)
        killer = threading.Timer(2 * grace, self.exit_process, (HANG_EXIT_CODE,))  # if the store does not answer
        killer.daemon = True
        killer.start()
        mine = describe(self.record.snapshot(), self.rank, self.group_names)
        sys.stderr.write(f"hang report (rank {self.rank}): {json.dumps(mine)}\n{_flight_recorder_note()}"
                         f"{thread_stacks()}\n")
        sys.stderr.flush()
        if self.store is None:
            return None
        self.store.set(f"record/{self.rank}", json.dumps(mine))
        if self.store.add("reporters", 1) != 1:
            _wait(self.store, ["summary"], 2 * grace)
            return None
        records = {self.rank: mine}
        _wait(self.store, [f"record/{r}" for r in range(self.world_size)], grace)
        for r in range(self.world_size):
            if r != self.rank and self.store.check([f"record/{r}"]):
                records[r] = json.loads(self.store.get(f"record/{r}"))
        summary = hang_summary(records, self.world_size, timeout_s)
        sys.stderr.write(f"error (rank {self.rank}): {summary}\n")
        sys.stderr.flush()
        self.store.set("summary", summary)
        return summary


def _wait(store, keys: list[str], seconds: float) -> None:
    with contextlib.suppress(RuntimeError):  # some never came: report what did
        store.wait(keys, datetime.timedelta(seconds=seconds))


def hang_deadline(config: Config) -> HangDeadline | None:
    """The deadline --hang-timeout-seconds sets (None for 0: no watchdog)."""
    t = config.training
    if t.hang_timeout_seconds == 0:
        return None
    return HangDeadline(t.hang_timeout_seconds, 30 * t.distributed_timeout_minutes)


def start_watchdog(config: Config, pstate: ParallelState) -> HangWatchdog | None:
    """This rank's watchdog, disarmed, for a run of more than one rank with a deadline."""
    deadline = hang_deadline(config)
    if pstate.layout.world_size == 1 or deadline is None:
        return None
    RECORD.reset()
    return HangWatchdog(deadline, pstate.rank, pstate.layout.world_size, pstate.group_names(),
                        lifecycle.report_store(pstate.timeout))


@contextlib.contextmanager
def unwatched(watchdog: HangWatchdog | None):
    """The block runs with the watchdog disarmed (a checkpoint save), and re-armed after it."""
    if watchdog is None:
        yield
        return
    watchdog.disarm()
    try:
        yield
    finally:
        watchdog.arm()
