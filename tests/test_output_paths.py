"""Every location a run writes is probed at start-up on every rank: one line naming the flag, the path and the
host, before any data is read, any model built or any step trained; a rank that dies during start-up is named as
exited, not as stuck."""

import datetime
import multiprocessing
import os
import socket

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.errors import UserError
from megatron_lite.files import OutputPathError
from megatron_lite.parallel import lifecycle
from megatron_lite.training.loop import pretrain
from tests.test_cli_errors import fails_on_every_rank_with_one_line

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
        "num_attention_heads": 2, "vocab_size": 64, "seq_length": 16, "max_position_embeddings": 16,
        "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 2}


def _flags(root) -> dict:
    """Each written location, placed where it cannot be written: under a regular file, or a directory where a
    file is meant (and the other way round); the problem each rank must report."""
    blocker = root / "a_file"
    below = blocker / "below"
    return {
        "profile under a file": ({"profile": True, "profile_dir": str(below), "profile_step_start": 0,
                                  "profile_step_end": 1}, f"--profile-dir {below}", f"{blocker} is a file"),
        "metrics under a file": ({"metrics_jsonl": str(below / "m.jsonl")}, "--metrics-jsonl", f"{blocker} is a file"),
        "metrics a directory": ({"metrics_jsonl": str(root)}, f"--metrics-jsonl {root}", "it is a directory"),
        "tensorboard a file": ({"tensorboard_dir": str(blocker)}, f"--tensorboard-dir {blocker}", "it is a file"),
        "wandb under a file": ({"wandb_project": "p", "wandb_save_dir": str(below)}, "--wandb-save-dir",
                               f"{blocker} is a file"),
        "tracker under a file": ({"result_rejected_tracker_filename": str(below / "t.txt")},
                                 "--result-rejected-tracker-filename", f"{blocker} is a file"),
        "save under a file": ({"save": str(below)}, f"--save {below}", f"{blocker} is a file"),
    }


CASES = ["profile under a file", "metrics under a file", "metrics a directory", "tensorboard a file",
         "wandb under a file", "tracker under a file", "save under a file"]


@pytest.mark.parametrize("case", CASES)
def test_an_unwritable_output_fails_before_the_first_step(case, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    (tmp_path / "a_file").write_text("not a directory")
    flags, names, problem = _flags(tmp_path)[case]
    built = []
    monkeypatch.setattr(pretrain_gpt, "model_provider", lambda *args: built.append(args))
    with pytest.raises(UserError) as error:
        pretrain(make_config({**TINY, **flags}), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    message = str(error.value)
    assert names in message and f"cannot be written on {socket.gethostname()}: " in message, message
    assert problem in message and "\n" not in message, message
    assert not built, "a model was built before the outputs were probed"



def test_a_data_cache_under_a_file_fails_before_the_corpus_is_read(tmp_path):
    (tmp_path / "a_file").write_text("not a directory")
    values = {**TINY, "mock_data": False, "data_path": [str(tmp_path / "missing_corpus")],
              "tokenizer_type": "NullTokenizer", "data_cache_path": str(tmp_path / "a_file" / "cache")}
    with pytest.raises(OutputPathError, match=rf"--data-cache-path {tmp_path}/a_file/cache cannot be written on "
                                              rf".*{tmp_path}/a_file is a file"):
        pretrain(make_config(values), pretrain_gpt.model_provider, pretrain_gpt.forward_step)


def test_a_tensorboard_dir_under_a_file_fails_on_both_ranks_with_one_line(tmp_path):
    """Only the last rank writes TensorBoard; rank 0 must say the same, not wait for it."""
    (tmp_path / "a_file").write_text("not a directory")
    argv = ["--model-preset", "llama-tiny", "--mock-data", "--num-layers", "1", "--train-iters", "2",
            "--tensorboard-dir", str(tmp_path / "a_file" / "tb")]
    fails_on_every_rank_with_one_line(argv, f"--tensorboard-dir {tmp_path / 'a_file' / 'tb'} cannot be "
                                            f"written on {socket.gethostname()}")


def _exit_or_wait_at_the_start_up_barrier(rank: int, init_file: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 1:
        os._exit(1)  # dies during start-up without a word to the others
    try:
        lifecycle.startup_barrier(datetime.timedelta(seconds=60))
        results.put("passed")
    except lifecycle.PeerLostError as error:
        results.put(str(error))


def test_a_rank_that_dies_during_start_up_is_named_as_exited_not_stuck(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_exit_or_wait_at_the_start_up_barrier,
                               args=(rank, str(tmp_path / "init"), results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    message = results.get(timeout=50)  # well before the barrier's 60 s
    for worker in workers:
        worker.join(timeout=30)
    assert message.startswith("rank(s) 1 exited during start-up, after "), message


def test_a_stuck_rank_is_named_as_stuck():
    error = lifecycle.startup_failure("rank(s) 3", waited_s=600.0, timeout=datetime.timedelta(minutes=10))
    assert isinstance(error, lifecycle.CollectiveTimeoutError)
    assert str(error) == ("rank(s) 3 did not finish starting up within 10 min (--distributed-timeout-minutes): "
                          "they are stuck")
