"""Configuration: presets, YAML files and flags combine in the documented order; problems are one line each."""

import pytest

from megatron_lite.config import ConfigError, build_parser, make_config, parse_config
from megatron_lite.presets import MODEL_PRESETS


def test_presets_fill_model_flags_and_flags_win():
    config = parse_config(["--model-preset", "llama-tiny", "--mock-data", "--num-layers", "3"], world_size=1)
    assert config.model.num_layers == 3
    assert config.model.hidden_size == MODEL_PRESETS["llama-tiny"]["hidden_size"]
    assert config.model.num_query_groups < config.model.num_attention_heads  # GQA
    assert config.model.swiglu and config.model.normalization == "RMSNorm"


def test_required_presets_exist():
    for name in ("gpt2-124m", "llama-tiny", "llama3-8b"):
        make_config({"model_preset": name, "mock_data": True}, world_size=1)


def test_yaml_file_is_read_and_flags_override_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model-preset: llama-tiny\nmock_data: true\nlr: 0.5\nmicro-batch-size: 2\n")
    config = parse_config(["--config", str(path), "--lr", "0.25"], world_size=2)
    assert config.optimizer.lr == 0.25
    assert config.training.micro_batch_size == 2
    assert config.training.global_batch_size == 4  # default: one micro-batch per data-parallel rank
    assert config.parallel.data_parallel_size == 2


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("mock_data: true\nhidden-sise: 3\n")
    with pytest.raises(ConfigError, match="unknown configuration key 'hidden_sise'"):
        parse_config(["--config", str(path)], world_size=1)


def test_every_interface_flag_is_accepted():
    parser_flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    for flag in ("--num-layers", "--group-query-attention", "--rotary-base", "--untie-embeddings-and-output-weights",
                 "--tensor-model-parallel-size", "--sequence-parallel", "--context-parallel-size",
                 "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
                 "--expert-model-parallel-size", "--use-distributed-optimizer", "--data-parallel-sharding-strategy",
                 "--lr-decay-style", "--recompute-granularity", "--data-path", "--tokenizer-type", "--save",
                 "--load", "--metrics-jsonl", "--peak-tflops", "--wandb-project", "--moe-router-topk"):
        assert flag in parser_flags


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as error:
        make_config({"model_preset": "llama-tiny", "mock_data": True, "tensor_model_parallel_size": 2,
                     "sequence_parallel": True, "seq_length": 33, "max_position_embeddings": 64,
                     "num_query_groups": 1}, world_size=2)
    message = str(error.value)
    assert "num-query-groups (1) must be divisible by tensor-model-parallel-size (2)" in message
    assert "must be divisible by tensor-model-parallel-size (2) with --sequence-parallel" in message
    assert "\n" not in message


def test_data_path_is_required_without_mock_data():
    with pytest.raises(ConfigError, match="--data-path"):
        make_config({"model_preset": "llama-tiny"}, world_size=1)


def test_tensorboard_is_refused_rather_than_ignored():
    with pytest.raises(ConfigError, match="--tensorboard-dir is not supported"):
        make_config({"model_preset": "llama-tiny", "mock_data": True, "tensorboard_dir": "tb"}, world_size=1)
