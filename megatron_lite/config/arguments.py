"""Command-line and YAML parsing: Megatron-compatible flags -> a validated Config.

Every flag has Megatron-LM's name and maps to one Config field (dashes become underscores).
`parse_config(argv, world_size)` is the entry point: it applies a `--model-preset`, then a
`--config FILE.yaml`, then the explicit flags (flags win), and validates the result against the world
size (validation.py) before any process group exists, so that a bad layout fails on every rank with
one line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap

import yaml

from megatron_lite.config.flag_dependencies import given_flags
from megatron_lite.config.hybrid_layer_pattern import apply_hybrid_layer_pattern
from megatron_lite.config.presets import MODEL_PRESETS
from megatron_lite.config.sections import Config
from megatron_lite.config.validation import validate
from megatron_lite.data.samplers import iterations_in_samples
from megatron_lite.errors import ConfigError
from megatron_lite.files import read_text

__all__ = ["ConfigError", "build_parser", "field_docs", "make_config", "parse_config"]

# Flags that are switches (store_true) and flags that take several values; the rest take one value
# whose type is read off the dataclass field.
_CHOICES = {
    "experimental_attention_variant": ["gated_delta_net"],
    "softmax_type": ["vanilla", "learnable", "off-by-one"],
    "fault_tolerance": ["torchft"],
    "normalization": ["LayerNorm", "RMSNorm"],
    "position_embedding_type": ["learned_absolute", "rope", "yarn", "none"],
    "moe_token_dispatcher_type": ["alltoall", "allgather"],
    "moe_router_score_function": ["softmax", "sigmoid"],
    "moe_router_load_balancing_type": ["aux_loss", "seq_aux_loss", "none"],
    "cp_comm_type": ["p2p", "allgather", "a2a", "a2a+p2p"],
    "pipeline_schedule": ["1f1b", "gpipe", "zb-h1"],
    "data_parallel_sharding_strategy": ["no_shard", "optim", "optim_grads", "optim_grads_params"],
    "lr_decay_style": ["constant", "linear", "cosine", "WSD"],
    "lr_wsd_decay_style": ["linear", "cosine", "exponential", "minus_sqrt"],
    "weight_decay_incr_style": ["constant", "linear", "cosine"],
    "recompute_granularity": ["full", "selective"],
    "recompute_method": ["uniform", "block"],
    "attention_backend": ["auto", "flash", "sdpa"],
    "device": ["auto", "cuda", "cpu"],
    "tokenizer_type": ["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"],
    "rerun_mode": ["disabled", "validate_results", "report_stats"],
    "fp8_format": ["e4m3", "hybrid"],
    "fp8_recipe": ["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise", "custom"],
    "optimizer": ["adam", "muon"],
    "sft_tokenizer_prompt_format": ["chatml", "nemotron-h-aligned", "nemotron-nano-v2"],
    "sft_long_conversations": ["truncate", "drop"],
    "muon_scale_mode": ["spectral", "unit_rms_norm", "shape_scaling"],
    "muon_coefficient_type": ["simple", "quintic", "polar_express", "aol"],
    "muon_tp_mode": ["duplicated", "distributed", "blockwise"],
    "muon_scalar_optimizer": ["adam", "lion"],
}
_DERIVED = {"data_parallel_size"}
# Flags that take a fixed number of values, by the name of each value.
_VALUE_NAMES = {"rampup_batch_size": ("START", "INCREMENT", "SAMPLES"), "window_size": ("LEFT", "RIGHT"),
                "hierarchical_context_parallel_sizes": ("A", "B")}


def field_owner() -> dict[str, str]:
    """Map every flag's field name to the section that holds it."""
    owner = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            if f.name not in _DERIVED:
                owner[f.name] = section.name
    return owner


def _value_type(f: dataclasses.Field):
    text = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float), ("list", list), ("str", str)):
        if text.startswith(name):
            return kind
    raise TypeError(f"config field {f.name} has an unsupported type {f.type}")


def _item_type(f: dataclasses.Field):
    """The type of each value of a list flag."""
    return int if str(f.type).startswith("list[int]") else str


def field_docs(section: type) -> dict[str, str]:
    """Each field's docstring (the string under it), which is its flag's --help, as torchtitan's job config has,
    for the section's own fields and those of the sections it extends. A field without one is a flag that does
    not say what it means: the parser refuses to be built."""
    docs = {}
    for part in reversed(section.__mro__[:-1]):
        body = ast.parse(textwrap.dedent(inspect.getsource(part))).body[0].body
        for statement, following in zip(body, body[1:] + [None]):
            if isinstance(statement, ast.AnnAssign):
                documented = (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                              and isinstance(following.value.value, str))
                if not documented:
                    raise TypeError(f"config field {part.__name__}.{statement.target.id} has no docstring; write "
                                    f"what its flag means under it")
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="Pretrain a GPT or Llama model (dense or MoE) with TP/SP/CP/PP/EP/DP and ZeRO.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", help="YAML file of flag values (keys are flag names, _ for -); flags win")
    for section in dataclasses.fields(Config):
        group = parser.add_argument_group(section.name)
        docs = field_docs(section.default_factory)
        for f in dataclasses.fields(section.default_factory()):
            if f.name in _DERIVED:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _value_type(f)
            doc = docs[f.name]
            default = f.default if f.default is not dataclasses.MISSING else "[]"
            help_text = doc if "default: " in doc else f"{doc}; default: {default}"
            if kind is bool and f.default:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text)
            elif kind is bool:
                group.add_argument(flag, action="store_true", help=help_text)
            elif kind is list:
                names = _VALUE_NAMES.get(f.name)
                group.add_argument(flag, nargs=len(names) if names else "+", metavar=names, type=_item_type(f),
                                   help=doc)
            else:
                group.add_argument(flag, type=kind, choices=_CHOICES.get(f.name), help=help_text)
    return parser


def parse_config(argv: list[str] | None = None, world_size: int = 1) -> Config:
    """Build and validate the run configuration: preset < YAML file < command-line flags."""
    parser = build_parser()
    try:
        flags = vars(parser.parse_args(argv))
    except SystemExit as exit_:
        if exit_.code:
            raise ConfigError("invalid command line (see the usage line above)") from None
        raise
    values = {}
    if "config" in flags:
        values.update(_read_yaml(flags.pop("config")))
    values.update(flags)
    return make_config(values, world_size)


def with_preset(values: dict) -> dict:
    """Flat flag values (field names) over the values of their --model-preset, if they name one."""
    preset = values.get("model_preset")
    if preset is None:
        return dict(values)
    if preset not in MODEL_PRESETS:
        raise ConfigError(f"unknown --model-preset '{preset}'; choose one of: {', '.join(MODEL_PRESETS)}")
    return {**MODEL_PRESETS[preset], **values}


def make_config(values: dict, world_size: int = 1) -> Config:
    """Build a validated Config from flat flag values (field names), applying a model preset first."""
    owner = field_owner()
    merged = with_preset(values)
    config = Config()
    for name, value in merged.items():
        if name not in owner:
            raise ConfigError(f"unknown configuration key '{name}'; see pretrain_gpt.py --help")
        setattr(getattr(config, owner[name]), name, value)
    problems = apply_hybrid_layer_pattern(config, given_flags(values))
    if problems:
        raise ConfigError("; ".join(problems))
    _fill_defaults(config, world_size)
    validate(config, world_size, given_flags(merged))
    _fill_train_iters(config)
    return config


def _read_yaml(path: str) -> dict:
    """Flag values (by field name) from a YAML file, each checked against its flag's type."""
    text = read_text(path, ConfigError, "--config")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {path}{_yaml_error_line(error)}: not valid YAML "
                          f"({getattr(error, 'problem', None) or error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path} must hold a mapping of flag names to values")
    fields = {f.name: f for section in dataclasses.fields(Config)
              for f in dataclasses.fields(section.default_factory()) if f.name not in _DERIVED}
    values = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"unknown configuration key '{name}' in --config {path}; see pretrain_gpt.py --help")
        values[name] = _yaml_value(fields[name], key, value, path)
    return values


def _yaml_error_line(error: yaml.YAMLError) -> str:
    """':LINE' (1-based) where the parser gave up, or '' when it did not say."""
    mark = getattr(error, "problem_mark", None)
    return f":{mark.line + 1}" if mark is not None else ""


_YAML_TYPE_NAMES = {bool: "true or false (a YAML bool, unquoted)", int: "an integer", float: "a number",
                    str: "a string (quote it)", list: "a list of strings, or one string"}


def _yaml_value(f: dataclasses.Field, key, value, path: str):
    """`value` as its flag's type, or a ConfigError naming the key and the file.

    YAML types values itself: `mock_data: "false"` is a string, which Python takes as true, and
    `split: 100` is an int. argparse would refuse or convert these, so we check them as strictly. One
    leniency: PyYAML (YAML 1.1) reads `lr: 3e-4` as a string, so a float flag takes a numeric string.
    """
    kind = _value_type(f)
    if value is None and "None" in str(f.type):
        return None
    if str(f.type).startswith("str | int") and isinstance(value, (int, list)) and not isinstance(value, bool):
        return value  # --moe-layer-freq: an integer or a list of 0s and 1s, as well as an expression

    if kind is bool and isinstance(value, bool):
        return value
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int and is_number and isinstance(value, int):
        return value
    if kind is float and (is_number or isinstance(value, str)):
        try:
            return float(value)
        except ValueError:
            pass
    if kind is str and isinstance(value, str):
        choices = _CHOICES.get(f.name)
        if choices and value not in choices:
            raise ConfigError(f"--config {path}: {key} is {value!r}; choose one of {', '.join(choices)}")
        return value
    if kind is list and _item_type(f) is int:
        if isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return value
        raise ConfigError(f"--config {path}: {key} must be a list of integers, got {type(value).__name__} {value!r}")
    if kind is list:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list) and items and all(
                isinstance(item, str) or (isinstance(item, (int, float)) and not isinstance(item, bool))
                for item in items):
            return [str(item) for item in items]
    raise ConfigError(f"--config {path}: {key} must be {_YAML_TYPE_NAMES[kind]}, "
                      f"got {type(value).__name__} {value!r}")


def _fill_defaults(config: Config, world_size: int) -> None:
    m, p, t, o = config.model, config.parallel, config.training, config.optimizer
    m.ffn_hidden_size = _default_if_unset(m.ffn_hidden_size, 4 * m.hidden_size)
    m.moe_ffn_hidden_size = _default_if_unset(m.moe_ffn_hidden_size, m.ffn_hidden_size)
    if not m.group_query_attention or m.num_query_groups is None:
        m.num_query_groups = m.num_attention_heads
    m.max_position_embeddings = _default_if_unset(m.max_position_embeddings, m.seq_length)
    model_parallel = p.tensor_model_parallel_size * p.context_parallel_size * p.pipeline_model_parallel_size
    p.data_parallel_size = max(world_size // model_parallel, 1) if model_parallel > 0 else 1
    if p.use_distributed_optimizer and p.data_parallel_sharding_strategy == "no_shard":
        p.data_parallel_sharding_strategy = "optim"  # Megatron's: one reduce-scatter per step, sharded optimizer
    t.global_batch_size = _default_if_unset(t.global_batch_size, t.micro_batch_size * p.data_parallel_size)
    if t.train_samples is None:
        t.train_iters = _default_if_unset(t.train_iters, 100)
        o.lr_decay_iters = _default_if_unset(o.lr_decay_iters, t.train_iters)
    else:  # the iteration flags stay unset, for validation to refuse them beside --train-samples
        o.lr_decay_samples = _default_if_unset(o.lr_decay_samples, t.train_samples)


def _fill_train_iters(config: Config) -> None:
    """With --train-samples, the iterations are the whole global batches they hold (after validation, which
    makes sure the batch sizes are sound)."""
    t = config.training
    if t.train_samples is not None:
        t.train_iters = iterations_in_samples(t.train_samples, t.global_batch_size, config.global_batch_size_at)


def _default_if_unset(value, default):
    """`default` only for a flag left unset: an explicit 0 stays, for validation to refuse."""
    return default if value is None else value
