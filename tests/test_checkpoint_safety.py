"""Checkpoints are safe to load: pickle payloads never run, killed saves never damage the previous checkpoint."""

import dataclasses
import io
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors
from megatron_lite.checkpoint.planner import (
    CheckpointError,
    SafeFileSystemReader,
    ShardedLoadPlanner,
    ShardedSavePlanner,
    state_dict_of,
)
from megatron_lite.checkpoint.sharded import ShardedTensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickling this creates `marker`: proof that loading ran code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _save_tensor(path: str) -> None:
    pieces = [ShardedTensor.whole("weight", torch.arange(12.0).view(3, 4))]
    dcp.save(state_dict_of(pieces), storage_writer=dcp.FileSystemWriter(path), planner=ShardedSavePlanner(pieces),
             no_dist=True)


def test_payload_works_when_unpickled_plainly(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists(), "the payload used by the tests below does run code under plain pickle"


def test_pickle_payload_as_dcp_metadata_is_refused(tmp_path):
    path, marker = str(tmp_path / "ckpt"), tmp_path / "ran"
    _save_tensor(path)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(CheckpointError, match=r"refers to io.open.*refusing"):
        read_checkpoint_tensors(path)
    assert not marker.exists()


def test_pickle_payload_as_tensor_data_is_refused(tmp_path):
    path, marker = str(tmp_path / "ckpt"), tmp_path / "ran"
    _save_tensor(path)
    metadata = SafeFileSystemReader(path).read_metadata()
    (index, info), = metadata.storage_data.items()
    payload = io.BytesIO()
    torch.save(Payload(str(marker)), payload)
    with open(os.path.join(path, info.relative_path), "wb") as f:
        f.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=0, length=len(payload.getvalue()))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointException, match="Unsupported global: GLOBAL io.open"):
        read_checkpoint_tensors(path)
    assert not marker.exists()


def test_pickled_object_entry_is_never_unpickled(tmp_path):
    path, marker = str(tmp_path / "ckpt"), tmp_path / "ran"
    dcp.save({"weight": Payload(str(marker))}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    assert not marker.exists()
    target = [ShardedTensor.whole("weight", torch.zeros(3, 4))]
    with pytest.raises(CheckpointException, match="checkpoint entry 'weight' is not a tensor"):
        dcp.load(state_dict_of(target), storage_reader=SafeFileSystemReader(path),
                 planner=ShardedLoadPlanner(target), no_dist=True)
    assert not marker.exists()


def test_interrupted_saves_and_deletions_are_never_taken_for_checkpoints(tmp_path):
    root = str(tmp_path)
    for iteration in (2, 4):
        path = directory.prepare(root, iteration)
        _save_tensor(path)
        directory.commit(root, iteration, {"iteration": iteration}, keep_last_n=None)
    # A save killed before its commit, and a deletion (--keep-last-n) killed half-way.
    _save_tensor(directory.prepare(root, 6))
    os.replace(directory.checkpoint_path(root, 2), directory.checkpoint_path(root, 2) + ".deleting")
    assert directory.complete_iterations(root) == [4]
    assert directory.read_tracker(root) == 4
    assert torch.equal(read_checkpoint_tensors(directory.checkpoint_path(root, 4))["weight"],
                       torch.arange(12.0).view(3, 4))
    directory.prepare(root, 8)  # the next save clears the leftovers
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000008.tmp", directory.TRACKER_FILE]


def test_keep_last_n_never_deletes_the_newest(tmp_path):
    root = str(tmp_path)
    for iteration in range(1, 5):
        _save_tensor(directory.prepare(root, iteration))
        directory.commit(root, iteration, {"iteration": iteration}, keep_last_n=1)
        assert directory.complete_iterations(root) == [iteration]


def test_kill_minus_nine_then_restart_resumes_from_newest_complete(tmp_path):
    """One round of tools/checkpoint_kill_drill.py (the full drill runs 10) plus its SIGTERM round."""
    drill = os.path.join(os.path.dirname(__file__), "..", "tools", "checkpoint_kill_drill.py")
    result = subprocess.run([sys.executable, drill, "--rounds", "1", "--dir", str(tmp_path), "--seed", "3"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 unloadable checkpoints" in result.stdout
    assert "exited 0" in result.stdout
