"""Layouts that tensor or sequence parallelism cannot split fail in make_config, one line, no process group."""

import pytest
import torch.distributed as dist

from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.training.loop import padded_vocab_for

BASE = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "seq_length": 32,
        "max_position_embeddings": 32}


@pytest.mark.parametrize(("values", "message"), [
    ({"tensor_model_parallel_size": 4, "num_attention_heads": 6, "hidden_size": 96, "num_query_groups": 2},
     "num-attention-heads (6) must be divisible by tensor-model-parallel-size (4)"),
    ({"tensor_model_parallel_size": 4, "num_query_groups": 2},
     "num-query-groups (2) must be divisible by tensor-model-parallel-size (4)"),
    ({"tensor_model_parallel_size": 4, "num_query_groups": 4, "sequence_parallel": True, "seq_length": 30},
     "seq-length / context-parallel-size (30) must be divisible by tensor-model-parallel-size (4) with "
     "--sequence-parallel"),
    ({"tensor_model_parallel_size": 4, "num_query_groups": 4, "ffn_hidden_size": 382},
     "ffn-hidden-size (382) must be divisible by tensor-model-parallel-size (4)"),
])
def test_bad_tensor_parallel_layout_is_one_line_before_any_collective(values, message):
    with pytest.raises(ConfigError) as error:
        make_config({**BASE, **values}, world_size=4)
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert not dist.is_initialized()


def test_sequence_parallel_is_accepted_when_everything_divides():
    config = make_config({**BASE, "tensor_model_parallel_size": 4, "num_query_groups": 4,
                          "sequence_parallel": True}, world_size=8)
    assert config.parallel.data_parallel_size == 2


def test_sequence_parallel_at_tp1_is_refused_as_a_flag_that_would_do_nothing():
    with pytest.raises(ConfigError, match="--sequence-parallel acts only with --tensor-model-parallel-size above 1"):
        make_config({**BASE, "sequence_parallel": True}, world_size=2)


@pytest.mark.parametrize(("tp", "padded"), [(1, 1000), (2, 1000), (4, 1200), (8, 1600)])
def test_vocabulary_is_padded_to_a_multiple_of_divisible_by_times_tp(tp, padded):
    config = make_config({**BASE, "vocab_size": 1000, "make_vocab_size_divisible_by": 100, "num_attention_heads": 8,
                          "num_query_groups": 8, "tensor_model_parallel_size": tp}, tp)
    assert padded_vocab_for(config) == padded
