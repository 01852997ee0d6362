"""Checkpoints that lie fail loudly: a tracker naming a lost iteration, damaged files, tensors the model has no
place for, a second run in the same save directory, a save directory nobody can write. Each is one
CheckpointError (one line on every rank) before training starts, never a silent partial or fresh start."""

import importlib.util
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import checksums, directory
from megatron_lite.checkpoint.checkpointing import Checkpointer
from megatron_lite.checkpoint.planner import CheckpointError
from megatron_lite.config.arguments import make_config
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.loop import initialize, pretrain
from tests.harness import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
        "num_query_groups": 2, "ffn_hidden_size": 64, "vocab_size": 64, "seq_length": 16,
        "max_position_embeddings": 16, "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 2,
        "lr": 1e-3, "lr_warmup_iters": 0, "eval_interval": 1000, "log_interval": 1000}


def train(values: dict, world_size: int = 1) -> list[float]:
    config = make_config({**TINY, **values}, world_size)
    return [h["lm_loss"] for h in pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)]


def _first_error(fn, *args) -> str | None:
    """The CheckpointError message `fn(*args)` raises on this rank (None when it does not raise)."""
    try:
        fn(*args)
    except CheckpointError as error:
        return str(error)
    return None


def _saved_twice(root: str, async_save: bool = False) -> None:
    """Complete checkpoints at iterations 1 and 2 (tracker: 2)."""
    train({"save": root, "save_interval": 1, "async_save": async_save})
    assert directory.complete_iterations(root) == [1, 2] and directory.read_tracker(root) == 2


# ---------------------------------------------------------------------------------------------------------
# Which iteration loads


def test_a_tracker_naming_a_lost_iteration_is_an_error_and_ckpt_step_loads_another(tmp_path):
    root = str(tmp_path)
    _saved_twice(root)
    directory._remove(directory.checkpoint_path(root, 2))
    with pytest.raises(CheckpointError, match=rf"{directory.TRACKER_FILE} names iteration 2, but .*iter_0000002 is "
                                              r"not a complete checkpoint; the newest complete one is iteration 1: "
                                              r"pass --ckpt-step 1"):
        train({"load": root, "train_iters": 3})
    assert len(train({"load": root, "ckpt_step": 1, "train_iters": 3})) == 2  # iterations 2 and 3
    with pytest.raises(CheckpointError, match=r"--ckpt-step 5: .* complete iterations in .*: \[1\]"):
        train({"load": root, "ckpt_step": 5})


def test_ckpt_step_loads_an_older_iteration_and_an_empty_directory_trains_from_scratch(tmp_path):
    root = str(tmp_path / "ckpt")
    _saved_twice(root)
    assert len(train({"load": root, "ckpt_step": 1, "train_iters": 2})) == 1
    assert len(train({"load": str(tmp_path / "empty"), "train_iters": 1})) == 1


# ---------------------------------------------------------------------------------------------------------
# Damaged files


def _truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) // 2)


def _flip_bytes(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _inspect_tool():
    spec = importlib.util.spec_from_file_location("inspect_checkpoint", os.path.join(ROOT, "tools",
                                                                                       "inspect_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize("damage, found", [(_truncate, r"holds \d+ bytes, \d+ were written"),
                                           (_flip_bytes, r"has CRC-32 \w+, \w+ was written")])
def test_a_damaged_file_of_the_newest_checkpoint_is_named_and_the_previous_one_offered(tmp_path, damage, found,
                                                                                       capsys):
    root = str(tmp_path)
    _saved_twice(root, async_save=True)  # checksums are taken by the background save too
    damage(os.path.join(directory.checkpoint_path(root, 2), "__0_0.distcp"))
    with pytest.raises(CheckpointError, match=rf"checkpoint .*iter_0000002 is damaged: __0_0.distcp {found}.*; "
                                              r"pass --ckpt-step 1 to load the previous complete checkpoint"):
        train({"load": root, "train_iters": 3})
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        _inspect_tool().main([root, "--check"])
    assert exited.value.code == 1
    assert "__0_0.distcp" in capsys.readouterr().out
    _inspect_tool().main([root, "--iteration", "1", "--check"])
    assert "2 files match their checksums" in capsys.readouterr().out


def test_a_damaged_dcp_index_is_named(tmp_path):
    root = str(tmp_path)
    _saved_twice(root)
    _flip_bytes(os.path.join(directory.checkpoint_path(root, 2), ".metadata"))
    with pytest.raises(CheckpointError, match=r"damaged: .metadata has CRC-32"):
        train({"load": root, "train_iters": 3})


def test_a_checkpoint_saved_without_checksums_still_loads(tmp_path, capsys):
    root = str(tmp_path)
    _saved_twice(root)
    path = directory.checkpoint_path(root, 2)
    saved = directory.read_metadata(path)
    del saved["files"]
    with open(os.path.join(path, directory.METADATA_FILE), "w") as f:
        json.dump(saved, f)
    assert len(train({"load": root, "train_iters": 3})) == 1
    assert "saved without checksums: loading it unverified" in capsys.readouterr().out


def _save_then_damage_the_file_rank_1_verifies(root: str) -> str | None:
    """Two ranks save (one data file each), then the file rank 1 checks when loading is damaged: both ranks
    must stop with rank 1's finding."""
    train({"save": root, "train_iters": 1}, world_size=2)
    path = directory.checkpoint_path(root, 1)
    records = directory.read_metadata(path)["files"]
    if torch.distributed.get_rank() == 0:
        _flip_bytes(os.path.join(path, checksums.share_of(records, 1, 2)[0]))
    torch.distributed.barrier()
    return _first_error(train, {"load": root}, 2)


def test_damage_one_rank_finds_stops_every_rank_with_its_message(tmp_path):
    errors = run_on_ranks(2, _save_then_damage_the_file_rank_1_verifies, str(tmp_path))
    assert errors[0] == errors[1] and "is damaged" in errors[0], errors


def test_commit_refuses_a_save_whose_files_are_missing(tmp_path):
    root = str(tmp_path)
    temporary = directory.prepare(root, 3)
    with open(os.path.join(temporary, "__0_0.distcp"), "wb") as f:
        f.write(b"written")
    files = {name: {"bytes": 7, "crc32": "0"} for name in ("__0_0.distcp", "__1_0.distcp")}
    with pytest.raises(CheckpointError, match=r"not committing the checkpoint of iteration 3: __1_0.distcp is "
                                              r"missing from .*another process"):
        directory.commit(root, 3, {"iteration": 3, "files": files})
    assert directory.complete_iterations(root) == [] and directory.read_tracker(root) is None


# ---------------------------------------------------------------------------------------------------------
# Tensors the model has no place for


def test_a_checkpoint_with_more_layers_than_the_model_is_an_error(tmp_path):
    train({"save": str(tmp_path), "num_layers": 4, "train_iters": 1})
    with pytest.raises(CheckpointError, match=r"holds model tensor 'decoder.layers.2.\S+', which this model has no "
                                              r"place for; it was saved with num_layers 4 \(this run: 2\)"):
        train({"load": str(tmp_path), "finetune": True})


def _pipeline_loads(root: str, num_layers: int) -> str | None:
    return _first_error(train, {"load": root, "pipeline_model_parallel_size": 2, "num_layers": num_layers,
                                "finetune": True, "train_iters": 1}, 2)


def test_pipeline_stages_together_must_load_every_stored_layer(tmp_path):
    """Each stage loads only its own layers: the check is over the union of the ranks."""
    root = str(tmp_path)
    train({"save": root, "num_layers": 4, "train_iters": 1})
    assert run_on_ranks(2, _pipeline_loads, root, 4) == [None, None]
    errors = run_on_ranks(2, _pipeline_loads, root, 2)
    assert errors[0] == errors[1] and "holds model tensor 'decoder.layers.2." in errors[0]


# ---------------------------------------------------------------------------------------------------------
# The save directory


def _checkpointer(root: str) -> Checkpointer:
    return Checkpointer(make_config({**TINY, "save": root}), ParallelState.single(), torch.device("cpu"))


def test_a_second_checkpointer_on_one_save_directory_is_refused_until_the_first_closes(tmp_path):
    first = _checkpointer(str(tmp_path))
    with pytest.raises(CheckpointError, match=rf"--save {tmp_path} is in use by another run \(host "
                                              rf"{socket.gethostname()} pid {os.getpid()}\)"):
        _checkpointer(str(tmp_path))
    first.close()
    _checkpointer(str(tmp_path))  # dropped without close (a run that failed in a longer-lived process)
    _checkpointer(str(tmp_path)).close()


def _two_checkpointers(root: str) -> str | None:
    config = make_config({**TINY, "save": root}, 2)
    pstate, device = initialize(config)
    first = Checkpointer(config, pstate, device)
    error = _first_error(Checkpointer, config, pstate, device)
    first.close()
    return error


def test_a_second_run_on_a_locked_save_directory_is_refused_on_every_rank(tmp_path):
    errors = run_on_ranks(2, _two_checkpointers, str(tmp_path))
    assert errors[0] == errors[1] and f"pid {os.getpid()}" not in errors[0] and "is in use by another run" in errors[0]


def test_a_second_process_is_refused_with_one_line_naming_the_holder(tmp_path):
    holder = _checkpointer(str(tmp_path))
    flags = ["--model-preset", "llama-tiny", "--mock-data", "--num-layers", "1", "--hidden-size", "32",
             "--num-attention-heads", "2", "--vocab-size", "64", "--seq-length", "16", "--micro-batch-size", "1",
             "--global-batch-size", "1", "--train-iters", "1", "--device", "cpu", "--save", str(tmp_path)]
    result = subprocess.run([sys.executable, "pretrain_gpt.py", *flags], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    holder.close()
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"error (rank 0): --save {tmp_path} is in use by another run (host {socket.gethostname()} pid "
        f"{os.getpid()}); one run per save directory: wait for it to finish, or choose another --save"]
    assert directory.complete_iterations(str(tmp_path)) == []


def _run_then_sleep(running) -> None:
    running.set()
    time.sleep(60)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork")
def test_a_forked_worker_does_not_keep_the_lock_of_a_finished_run(tmp_path):
    """Data-loader workers are forked after the lock is taken, and may outlive a killed run by seconds."""
    first = _checkpointer(str(tmp_path))
    context = multiprocessing.get_context("fork")
    running = context.Event()
    worker = context.Process(target=_run_then_sleep, args=(running,), daemon=True)
    worker.start()
    try:
        assert running.wait(timeout=60)
        first.close()
        _checkpointer(str(tmp_path)).close()
    finally:
        worker.kill()
        worker.join()


def test_an_unwritable_save_directory_fails_at_start_up(tmp_path):
    (tmp_path / "file.txt").write_text("a file, not a directory")  # refuses writes even to root
    save = str(tmp_path / "file.txt" / "ckpt")
    with pytest.raises(CheckpointError, match=rf"--save {save} cannot be written on {socket.gethostname()}: "
                                              rf"{tmp_path / 'file.txt'} is a file, not a directory"):
        _checkpointer(save)
