"""Configuration: presets, YAML files and flags combine in the documented order; problems are one line each."""

import dataclasses
import math

import pytest

from megatron_lite.config.arguments import ConfigError, build_parser, field_docs, make_config, parse_config
from megatron_lite.config.presets import MODEL_PRESETS
from megatron_lite.config.sections import Config


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


@pytest.mark.parametrize("line, message", [
    ('mock_data: "false"', r"run.yaml: mock_data must be true or false \(a YAML bool, unquoted\), got str 'false'"),
    ("micro-batch-size: 2.5", "run.yaml: micro-batch-size must be an integer, got float 2.5"),
    ("train_iters: true", "run.yaml: train_iters must be an integer, got bool True"),
    ("lr: fast", "run.yaml: lr must be a number, got str 'fast'"),
    ("split: 100", r"run.yaml: split must be a string \(quote it\), got int 100"),
    ("normalization: rmsnorm", "run.yaml: normalization is 'rmsnorm'; choose one of LayerNorm, RMSNorm"),
    ("data_path: {a: 1}", "run.yaml: data_path must be a list of strings, or one string, got dict"),
    ("num_layers:", "run.yaml: num_layers must be an integer, got NoneType None"),
])
def test_yaml_values_are_typed_like_their_flags(tmp_path, line, message):
    (tmp_path / "run.yaml").write_text(f"model_preset: llama-tiny\n{line}\n")
    with pytest.raises(ConfigError, match=message) as error:
        parse_config(["--config", str(tmp_path / "run.yaml")], world_size=1)
    assert "\n" not in str(error.value)


def test_yaml_values_of_the_right_type_are_taken(tmp_path):
    (tmp_path / "run.yaml").write_text("model_preset: llama-tiny\nmock_data: false\nlr: 3e-4\nmin_lr: 0\n"
                                       "split: '98,2,0'\ndata_path: [0.3, a, 0.7, b]\nffn_hidden_size: null\n")
    config = parse_config(["--config", str(tmp_path / "run.yaml")], world_size=1)
    assert config.data.mock_data is False
    assert config.optimizer.lr == 3e-4 and isinstance(config.optimizer.min_lr, float)  # YAML 1.1 reads 3e-4 as text
    assert config.data.split == "98,2,0" and config.data.data_path == ["0.3", "a", "0.7", "b"]
    assert config.model.ffn_hidden_size == 4 * config.model.hidden_size
    (tmp_path / "one.yaml").write_text("vocab_size: 64\ndata_path: corpus_text_document\n")
    assert parse_config(["--config", str(tmp_path / "one.yaml")]).data.data_path == ["corpus_text_document"]


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    (tmp_path / "run.yaml").write_text("mock_data: true\nlr: [0.1\nseed: 3\n")
    with pytest.raises(ConfigError, match=r"--config .*run.yaml:3: not valid YAML") as error:
        parse_config(["--config", str(tmp_path / "run.yaml")], world_size=1)
    assert "\n" not in str(error.value)


FLOAT_FLAGS = [f.name for section in dataclasses.fields(Config) for f in dataclasses.fields(section.default_factory())
               if str(f.type).startswith("float")]


@pytest.mark.parametrize("name", FLOAT_FLAGS)
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_every_float_flag_must_be_finite(name, value):
    with pytest.raises(ConfigError, match=rf"{name.replace('_', '-')} \({value}\) must be a finite number"):
        make_config({"model_preset": "llama-tiny", "mock_data": True, name: value}, world_size=1)


def test_non_finite_floats_are_refused_from_the_command_line():
    with pytest.raises(ConfigError, match=r"min-lr \(nan\) must be a finite number; adam-eps \(inf\) must be"):
        parse_config(["--model-preset", "llama-tiny", "--mock-data", "--min-lr", "nan", "--adam-eps", "inf"])


@pytest.mark.parametrize("values, message", [
    ({"micro_batch_size": 0}, r"micro-batch-size \(0\) must be at least 1"),
    ({"global_batch_size": 0}, r"global-batch-size \(0\) must be at least 1"),
    ({"global_batch_size": -8}, r"global-batch-size \(-8\) must be at least 1"),
    ({"num_attention_heads": 0}, r"num-attention-heads \(0\) must be at least 1"),
    ({"tensor_model_parallel_size": 0}, r"tensor-model-parallel-size \(0\) must be at least 1"),
    ({"eval_interval": 0, "seq_length": -1}, r"seq-length \(-1\) must be at least 1; eval-interval \(0\) must be"),
    ({"hidden_dropout": 1.5}, r"hidden-dropout \(1.5\) must be at least 0 and below 1"),
    ({"lr": -1e-3}, r"lr \(-0.001\) must not be negative"),
])
def test_sizes_and_counts_out_of_range_are_one_line_errors(values, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_config({"model_preset": "llama-tiny", "mock_data": True, **values}, world_size=1)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("values, message", [
    ({"tokenizer_type": "NullTokenizer", "vocab_size": None}, "--tokenizer-type NullTokenizer needs --vocab-size"),
    ({"tokenizer_type": "SentencePieceTokenizer"}, "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model"),
])
def test_a_tokenizer_without_its_file_or_vocabulary_is_refused_before_training(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config({"model_preset": "llama-tiny", "data_path": ["corpus_text_document"], **values}, world_size=1)


def test_ckpt_step_needs_a_checkpoint_directory():
    with pytest.raises(ConfigError, match="--ckpt-step acts only with --load"):
        make_config({"model_preset": "llama-tiny", "mock_data": True, "ckpt_step": 100})


def test_every_flag_says_what_it_means_from_its_field_docstring():
    """--help text is the field's docstring (and its default), for every flag of every section."""
    helps = {action.dest: action.help for action in build_parser()._actions}
    for section in dataclasses.fields(Config):
        docs = field_docs(section.default_factory)
        for field in dataclasses.fields(section.default_factory()):
            if field.name == "data_parallel_size":
                continue
            assert len(docs[field.name]) > 10, field.name
            assert helps[field.name].startswith(docs[field.name]), field.name
    assert helps["num_layers"] == "transformer layers of the decoder; default: 2"


def test_a_field_without_a_docstring_is_refused():
    @dataclasses.dataclass
    class Section:
        documented: int = 1
        """what it means"""
        undocumented: int = 2

    with pytest.raises(TypeError, match="Section.undocumented has no docstring"):
        field_docs(Section)


def _float_flags() -> list[str]:
    """Every configuration field whose value is a float number."""
    names = []
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else type(getattr(Config(),
                                                                                                     section.name))):
            if f.type in (float, "float", "float | None", float | None):
                names.append(f.name)
    return names


@pytest.mark.parametrize("value", [math.nan, -1e9])
def test_every_bad_float_is_named_once(value):
    """One owner per bound: a value outside its flag's range is one problem, not one per validator that reads
    it (a NaN once said 'must be a finite number; ... must be a number of at least 0'). On DeepSeek-V3 with Muon,
    so that the validators of multi-latent attention, YaRN, MTP and Muon all read their values."""
    flags = _float_flags()
    assert len(flags) > 40 and "mscale_all_dim" in flags and "muon_momentum" in flags
    for name in flags:
        try:
            make_config({"model_preset": "deepseek-v3", "mock_data": True, "optimizer": "muon", name: value})
            continue  # a value this flag may take (-1e9 for one without a lower bound)
        except ConfigError as error:
            problems = str(error).split("; ")
        flag = name.replace("_", "-")
        naming = [p for p in problems if f"{flag} ({value:g})" in p.replace("--", "") or f"{flag} ({value})" in p]
        assert len(naming) <= 1, (name, problems)
        if math.isnan(value):
            assert naming == [f"{flag} (nan) must be a finite number"], (name, problems)
