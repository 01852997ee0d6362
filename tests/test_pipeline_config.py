"""Pipeline layouts are validated before any process group exists: bad input is one line saying what to
change, and valid splits (uneven, interleaved) give each stage and model chunk the right global layers."""

import pytest

from megatron_lite.config import ConfigError, make_config
from megatron_lite.training import model_chunk_plans
from megatron_lite.validation import pipeline_stage_layers
from tests.test_pipeline_parallel import TINY_8_LAYERS


def error_for(values: dict, world_size: int) -> str:
    with pytest.raises(ConfigError) as info:
        make_config({**TINY_8_LAYERS, **values}, world_size)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_interleaving_needs_microbatches_divisible_by_pipeline_size():
    message = error_for({"pipeline_model_parallel_size": 4, "num_layers_per_virtual_pipeline_stage": 1,
                         "micro_batch_size": 1, "global_batch_size": 6}, 4)
    assert message == ("number of micro-batches (6) must be divisible by pipeline-model-parallel-size (4) for "
                       "the interleaved schedule")


def test_virtual_stages_need_pipeline_parallelism():
    message = error_for({"num_layers_per_virtual_pipeline_stage": 2}, 1)
    assert message == "--num-layers-per-virtual-pipeline-stage needs pipeline-model-parallel-size > 1"


def test_layers_not_divisible_by_stages_need_an_explicit_split():
    message = error_for({"num_layers": 7, "pipeline_model_parallel_size": 2}, 2)
    assert message == ("num-layers (7) cannot be split evenly over 2 pipeline stages; set "
                       "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")


def test_impossible_explicit_split_is_one_line():
    message = error_for({"num_layers": 7, "pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 8},
                        2)
    assert message.startswith("cannot split num-layers (7) into 2 pipeline stages with first=8")


def test_virtual_stage_size_must_divide_the_stage():
    message = error_for({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 3}, 2)
    assert message == "layers per pipeline stage (4) must be divisible by num-layers-per-virtual-pipeline-stage (3)"


def test_uneven_split_gives_first_and_last_stage_their_counts():
    config = make_config({**TINY_8_LAYERS, "num_layers": 10, "pipeline_model_parallel_size": 3,
                          "decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 3}, 3)
    assert pipeline_stage_layers(config) == [2, 5, 3]
    offsets = [(plan.layer_offset, plan.num_layers) for stage in range(3) for plan in model_chunk_plans(config, stage)]
    assert offsets == [(0, 2), (2, 5), (7, 3)]


def test_interleaved_chunks_take_every_pp_th_virtual_stage():
    config = make_config({**TINY_8_LAYERS, "pipeline_model_parallel_size": 2,
                          "num_layers_per_virtual_pipeline_stage": 2}, 2)
    plans = {stage: model_chunk_plans(config, stage) for stage in range(2)}
    assert [(p.layer_offset, p.pre_process, p.post_process) for p in plans[0]] == [(0, True, False), (4, False, False)]
    assert [(p.layer_offset, p.pre_process, p.post_process) for p in plans[1]] == [(2, False, False), (6, False, True)]
