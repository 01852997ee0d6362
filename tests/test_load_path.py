"""--load naming something that exists is never a silent fresh start: a checkpoint directory resumes, and one
iteration's directory, a file, a Hugging Face model, a damaged iteration or a directory one level above the
checkpoints is refused, before any model is built, with the flags that would work."""

import os

import pytest

import pretrain_gpt
from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.load_path import load_problem
from megatron_lite.checkpoint.planner import CheckpointError
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import pretrain

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
        "num_attention_heads": 2, "vocab_size": 64, "seq_length": 16, "max_position_embeddings": 16,
        "micro_batch_size": 2, "global_batch_size": 4, "lr_decay_iters": 10}


def _train(**flags) -> list[dict]:
    return pretrain(make_config({**TINY, **flags}), pretrain_gpt.model_provider, pretrain_gpt.forward_step)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A run of 3 iterations with checkpoints at 2 and 3."""
    root = str(tmp_path_factory.mktemp("run") / "ckpt")
    _train(train_iters=3, save=root, save_interval=2)
    assert directory.complete_iterations(root) == [2, 3]
    return root


def test_an_iteration_directory_is_refused_with_the_flags_that_load_it(saved):
    iteration_2 = directory.checkpoint_path(saved, 2)
    with pytest.raises(CheckpointError) as error:
        _train(train_iters=4, load=iteration_2, save=saved)
    assert str(error.value) == (f"--load {iteration_2} is the directory of one iteration; to resume from it pass "
                                f"--load {saved} --ckpt-step 2")
    assert directory.read_tracker(saved) == 3  # nothing saved, the tracker untouched
    resumed = _train(train_iters=4, load=saved, ckpt_step=2)  # the command it names works
    assert [h["iteration"] for h in resumed] == [3, 4]


def test_nothing_that_exists_is_taken_for_an_empty_checkpoint_directory(saved, tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "damaged" / "iter_0000004").mkdir(parents=True)
    (tmp_path / "above").mkdir()
    os.symlink(saved, tmp_path / "above" / "ckpt")
    assert "is a file; name the checkpoint directory" in load_problem(str(tmp_path / "a_file"))
    assert "holds a Hugging Face model" in load_problem(str(tmp_path / "hf"))
    assert "tools/convert_checkpoint.py --direction hf-to-mlite" in load_problem(str(tmp_path / "hf"))
    assert load_problem(str(tmp_path / "damaged")) == (
        f"--load {tmp_path / 'damaged'} holds iter_0000004, but it is not a complete checkpoint (no metadata.json or "
        f".metadata): it was damaged; remove it to train from scratch")
    assert load_problem(str(tmp_path / "above")) == (f"--load {tmp_path / 'above'} holds no checkpoint, but "
                                                     f"{tmp_path / 'above' / 'ckpt'} does: pass --load "
                                                     f"{tmp_path / 'above' / 'ckpt'}")


def test_a_checkpoint_directory_or_none_yet_is_no_problem(saved, tmp_path):
    assert load_problem(saved) is None
    assert load_problem(str(tmp_path / "not_yet")) is None  # the first run of --save DIR --load DIR
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")  # a first run that died before its first save
    (tmp_path / "empty" / "iter_0000002.tmp").mkdir()
    assert load_problem(str(tmp_path / "empty")) is None


def test_a_refused_load_builds_no_model(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    built = []
    monkeypatch.setattr(pretrain_gpt, "model_provider", lambda *args: built.append(args))
    with pytest.raises(CheckpointError, match="is a file"):
        pretrain(make_config({**TINY, "train_iters": 2, "load": str(tmp_path / "a_file")}),
                 pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    assert not built
