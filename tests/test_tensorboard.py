"""TensorBoard (--tensorboard-dir) receives the metrics JSONL's scalars under the same names, read back from the
event file; without the tensorboard package the flag is a one-line error naming the extra."""

import sys

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.training.loop import pretrain

TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "seq_length": 32,
        "max_position_embeddings": 32, "global_batch_size": 4, "micro_batch_size": 4}


def test_tensorboard_event_file_holds_the_training_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = make_config({**TINY, "train_iters": 4, "eval_interval": 2, "eval_iters": 1,
                          "tensorboard_dir": str(tmp_path), "tensorboard_log_interval": 2,
                          "log_memory_to_tensorboard": True})
    history = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm_loss", "grad_norm", "lr", "tokens_per_sec", "consumed_samples", "memory_gib", "valid_lm_loss"} <= tags
    assert not any(tag.startswith("time_") for tag in tags)  # without --log-timers-to-tensorboard
    lm_loss = events.Scalars("lm_loss")
    assert [event.step for event in lm_loss] == [2, 4]  # every --tensorboard-log-interval iterations
    assert [event.value for event in lm_loss] == pytest.approx([history[1]["lm_loss"], history[3]["lm_loss"]])
    assert [event.step for event in events.Scalars("valid_lm_loss")] == [2, 4]


def test_tensorboard_without_its_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'megatron-lite\[tensorboard\]'$"):
        make_config({**TINY, "tensorboard_dir": "tb"})
