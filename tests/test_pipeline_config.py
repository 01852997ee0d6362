"""Pipeline layouts are validated before any process group exists: bad input is one line saying what to
change, and valid splits (uneven, interleaved) give each stage and model chunk the right global layers."""

import pytest

from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.config.layer_split import model_chunk_plans, pipeline_stage_layers
from tests.harness import run_on_ranks
from tests.helpers import TINY_8_LAYERS, assert_run_matches, reference, train_and_collect


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
    assert message == ("--num-layers-per-virtual-pipeline-stage acts only with --pipeline-model-parallel-size above "
                       "1; add that or drop --num-layers-per-virtual-pipeline-stage")


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


def test_virtual_stages_per_rank_give_the_chunks_of_the_layers_per_virtual_stage():
    by_layers = make_config({**TINY_8_LAYERS, "pipeline_model_parallel_size": 2,
                             "num_layers_per_virtual_pipeline_stage": 2}, 2)
    by_stages = make_config({**TINY_8_LAYERS, "pipeline_model_parallel_size": 2,
                             "num_virtual_stages_per_pipeline_rank": 2}, 2)
    assert by_stages.virtual_pipeline_stages == by_layers.virtual_pipeline_stages == 2
    for stage in range(2):
        assert model_chunk_plans(by_stages, stage) == model_chunk_plans(by_layers, stage)


def test_virtual_stages_split_uneven_first_and_last_stages_as_megatron():
    config = make_config({**TINY_8_LAYERS, "num_layers": 10, "pipeline_model_parallel_size": 3,
                          "decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 4,
                          "num_virtual_stages_per_pipeline_rank": 2, "global_batch_size": 6}, 3)
    chunks = [[(plan.layer_offset, plan.num_layers) for plan in model_chunk_plans(config, stage)] for stage in range(3)]
    assert chunks == [[(0, 1), (5, 1)], [(1, 2), (6, 2)], [(3, 2), (8, 2)]]


@pytest.mark.parametrize(("values", "message"), [
    ({"num_virtual_stages_per_pipeline_rank": 2}, "--num-virtual-stages-per-pipeline-rank acts only "
     "with --pipeline-model-parallel-size above 1; add that or drop --num-virtual-stages-per-pipeline-rank"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 3,
      "num_virtual_stages_per_pipeline_rank": 2},
     "layers of pipeline stage 0 (3) must be divisible by num-virtual-stages-per-pipeline-rank (2)"),
    ({"pipeline_model_parallel_size": 2, "num_virtual_stages_per_pipeline_rank": 2,
      "num_layers_per_virtual_pipeline_stage": 2},
     "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank exclude each other (one "
     "would be ignored); give one of them"),
])
def test_bad_virtual_stages_are_one_line(values, message):
    assert error_for(values, values.get("pipeline_model_parallel_size", 1)) == message


def test_pp2_vp2_uneven_by_virtual_stages_per_rank_matches_single_device():
    values = {**TINY_8_LAYERS, "pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 2,
              "decoder_last_pipeline_num_layers": 6, "num_virtual_stages_per_pipeline_rank": 2}
    assert_run_matches(run_on_ranks(2, train_and_collect, values, 2), reference(TINY_8_LAYERS))
