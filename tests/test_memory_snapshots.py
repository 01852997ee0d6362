"""--record-memory-history: refused off CUDA with one line; on CUDA (its allocator calls stood in for here, as this
machine has none) the profiled ranks record from before the model is built and dump Megatron's file names, with
one line comparing the rank's peak to the planner's prediction for its stage."""

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.planning.layouts import plan_layout
from megatron_lite.planning.step_time import Hardware
from megatron_lite.training import memory_snapshots
from megatron_lite.training.loop import pretrain

TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
        "num_attention_heads": 2, "vocab_size": 64, "seq_length": 16, "max_position_embeddings": 16,
        "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 2}


def test_off_cuda_the_flag_is_refused_before_a_model_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(pretrain_gpt, "model_provider", lambda *args: built.append(args))
    with pytest.raises(ConfigError) as error:
        pretrain(make_config({**TINY, "record_memory_history": True, "device": "cpu"}), pretrain_gpt.model_provider,
                 pretrain_gpt.forward_step)
    assert str(error.value).startswith("--record-memory-history records the CUDA caching allocator, and this run "
                                       "is on the cpu: drop the flag")
    assert not built


class FakeAllocator:
    """The torch.cuda.memory calls MemoryHistory makes, recorded; a dump writes a small file."""

    def __init__(self, monkeypatch):
        self.recording, self.observer, self.dumps = [], None, []
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                            lambda enabled="all", **options: self.recording.append(enabled))
        monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", self.attach, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", self.dump)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)

    def attach(self, observer):
        self.observer = observer

    def dump(self, filename):
        self.dumps.append(filename)
        with open(filename, "w") as f:
            f.write("snapshot")


def test_profiled_ranks_record_and_dump_megatrons_file_names_beside_the_planners_prediction(monkeypatch, tmp_path,
                                                                                          capsys):
    allocator = FakeAllocator(monkeypatch)
    path = str(tmp_path / "mem.pickle")
    config = make_config({**TINY, "record_memory_history": True, "memory_snapshot_path": path,
                          "pipeline_model_parallel_size": 2, "profile_ranks": [1]}, world_size=2)
    cuda = torch.device("cuda", 0)
    assert not memory_snapshots.MemoryHistory(config, rank=0, pp_rank=0, device=cuda).enabled  # not profiled
    assert allocator.recording == []
    history = memory_snapshots.MemoryHistory(config, rank=1, pp_rank=1, device=cuda)
    assert allocator.recording == ["all"] and allocator.observer is not None
    history.dump(10)
    history.dump(20)  # the same file again, announced once
    assert allocator.dumps == [str(tmp_path / "mem_1.pickle")] * 2
    predicted = plan_layout(config, memory_bytes=0, hardware=Hardware()).stages[1].total
    lines = [line for line in capsys.readouterr().out.splitlines() if "memory snapshot" in line]
    assert lines == [f" rank 1: memory snapshot of iteration 10 written to {tmp_path / 'mem_1.pickle'} (peak "
                     f"allocated 3.00 GiB; the planner predicts {predicted / 2**30:.2f} GiB for this rank)"]
    allocator.observer(0, 2 * 2**30, 70 * 2**30, 2**29)
    assert allocator.dumps[-1] == str(tmp_path / "mem_oom_rank_1.pickle")
    out = capsys.readouterr().out
    assert "rank 1: out of memory asking for 2.00 GiB with 70.00 GiB allocated and 0.50 GiB free; memory snapshot " \
           f"written to {tmp_path / 'mem_oom_rank_1.pickle'}" in out
    history.close()
    assert allocator.recording == ["all", None]


def test_the_snapshot_path_is_probed_at_start_up_on_the_profiled_ranks(tmp_path):
    from megatron_lite.files import Location
    from megatron_lite.training.output_paths import written_locations

    config = make_config({**TINY, "record_memory_history": True, "memory_snapshot_path": str(tmp_path / "m.pickle")})
    assert Location("--memory-snapshot-path", str(tmp_path / "m_0.pickle"), True) in written_locations(config, 0, 1)
