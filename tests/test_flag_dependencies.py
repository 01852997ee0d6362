"""Every flag of the parser either stands alone or says what it needs; a flag given without it is one line naming
both flags, before torch is imported, never a run that trains as if the flag had not been typed."""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from megatron_lite.config.arguments import _CHOICES, ConfigError, build_parser, field_docs, make_config, parse_config
from megatron_lite.config.flag_dependencies import RULES, STANDS_ALONE, AnyOf, Excludes, Needs
from megatron_lite.config.presets import MODEL_PRESETS
from megatron_lite.config.sections import Config

BASE = {"mock_data": True, "vocab_size": 64, "num_layers": 4}
FIELDS = {f.name: f for section in dataclasses.fields(Config) for f in dataclasses.fields(section.default_factory())}


def _flags_of_the_parser() -> set[str]:
    return {action.dest for action in build_parser()._actions if action.dest not in ("help", "config")}


def test_every_flag_of_the_parser_has_an_entry_and_only_one():
    flags = _flags_of_the_parser()
    assert flags - RULES.keys() - STANDS_ALONE == set(), "add these flags to flag_dependencies.RULES or STANDS_ALONE"
    assert RULES.keys() & STANDS_ALONE == set()
    assert (RULES.keys() | STANDS_ALONE) - flags == set(), "entries for flags the parser does not have"


def test_the_flags_page_names_every_rule():
    page = (Path(__file__).resolve().parents[1] / "docs" / "flags.md").read_text()
    for name, rules in RULES.items():
        assert f"`--{name.replace('_', '-')}`" in page, name
        for rule in rules:
            for other in (rule.flags if isinstance(rule, (Needs, AnyOf)) else (rule.flag,)):
                assert f"`--{other.replace('_', '-')}" in page, (name, other)


def test_every_rule_names_flags_that_exist():
    for name, rules in RULES.items():
        for rule in rules:
            named = rule.flags if isinstance(rule, (Needs, AnyOf)) else (rule.flag,)
            assert set(named) <= FIELDS.keys(), (name, named)
            if isinstance(rule, Needs) and rule.values and rule.flags[0] in _CHOICES:
                assert set(rule.values) <= set(_CHOICES[rule.flags[0]]), (name, rule.values)


def test_a_help_text_that_says_with_another_flag_has_that_rule():
    """A flag documented as "with --X: ..." acts only with X: the table must say so too."""
    docs = {name: doc for section in dataclasses.fields(Config)
            for name, doc in field_docs(section.default_factory).items()}
    checked = []
    for name, doc in docs.items():
        match = re.match(r"with --([a-z0-9-]+)", doc)
        if match:
            checked.append(name)
            needed = match.group(1).replace("-", "_")
            assert any(isinstance(rule, Needs) and needed in rule.flags for rule in RULES.get(name, ())), name
    assert len(checked) > 20


def _sample_value(name: str):
    """A value of the flag's type that its own range check accepts."""
    f = FIELDS[name]
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    kind = str(f.type)
    if kind.startswith("bool"):
        return True
    if default not in (None, [], False):
        return default
    if name in _CHOICES:
        return _CHOICES[name][0]
    if kind.startswith("list[int]"):
        return [1, 1]
    if kind.startswith("list"):
        return ["corpus_text_document"]
    if kind.startswith("int"):
        return 2
    if kind.startswith("float"):
        return 0.5
    return "somewhere"


def _breaking_values(rule) -> dict:
    """Settings under which `rule` fails: the excluded flag on; for Needs, a choice it does not accept, else the
    defaults with what BASE sets (the assertion below checks that they fail it)."""
    if isinstance(rule, Excludes):
        return {rule.flag: _sample_value(rule.flag)}
    if isinstance(rule, AnyOf):
        return {key: value for condition in rule.conditions for key, value in _breaking_values(condition).items()}
    other = rule.flags[0]
    if rule.values and other in _CHOICES:
        return {other: next(choice for choice in _CHOICES[other] if choice not in rule.values)}
    return {}


@pytest.mark.parametrize("name, index", [(name, index) for name in sorted(RULES) for index in range(len(RULES[name]))])
def test_a_flag_given_without_what_it_needs_is_refused_with_one_line_naming_both(name, index):
    rule = RULES[name][index]
    values = {**BASE, **_breaking_values(rule), name: _sample_value(name)}
    with pytest.raises(ConfigError) as error:
        make_config(values, world_size=1)
    message = str(error.value)
    assert "\n" not in message
    flag = "--" + name.replace("_", "-")
    if isinstance(rule, Excludes):
        assert f"{flag} and --{rule.flag.replace('_', '-')} exclude each other" in message, message
    else:
        assert f"{flag} acts only with {rule.says()}" in message, message


@pytest.mark.parametrize("command, message", [
    ("--kv-lora-rank 16", "--kv-lora-rank acts only with --multi-latent-attention"),
    ("--qk-head-dim 32 --v-head-dim 32", "--qk-head-dim acts only with --multi-latent-attention"),
    ("--qk-pos-emb-head-dim 16", "--qk-pos-emb-head-dim acts only with --multi-latent-attention"),
    ("--mtp-loss-scaling-factor 0.3", "--mtp-loss-scaling-factor acts only with --mtp-num-layers"),
    ("--fp8-recipe tensorwise", "--fp8-recipe acts only with --fp8-format"),
    ("--fp8-format e4m3 --bf16 --num-layers-at-start-in-bf16 1",
     "--num-layers-at-start-in-bf16 acts only with --first-last-layers-bf16"),
    ("--moe-layer-freq 2", "--moe-layer-freq acts only with --num-experts"),
    ("--bf16 --fp16", "--bf16 and --fp16 exclude each other"),
    ("--train-iters 10 --train-samples 80", "--train-iters and --train-samples exclude each other"),
    ("--mock-data --data-path corpus_text_document", "--data-path and --mock-data exclude each other"),
])
def test_the_flags_found_ignored_are_refused_from_the_command_line(command, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(shlex.split(f"--model-preset llama-tiny --mock-data {command}"), world_size=1)


def test_a_flag_set_false_or_null_in_yaml_is_not_given(tmp_path):
    (tmp_path / "run.yaml").write_text("model_preset: llama-tiny\nmock_data: true\nfirst_last_layers_bf16: false\n"
                                       "mtp_num_layers: null\nasync_save: false\n")
    config = parse_config(["--config", str(tmp_path / "run.yaml")], world_size=1)
    assert not config.model.first_last_layers_bf16 and not config.checkpoint.async_save


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_every_preset_sets_only_flags_that_act(preset):
    config = make_config({"model_preset": preset, "mock_data": True, "vocab_size": 64}, world_size=1)
    assert config.model.model_preset == preset


def test_a_rule_that_holds_lets_the_flag_through():
    config = make_config({**BASE, "multi_latent_attention": True, "kv_lora_rank": 16, "position_embedding_type": "rope",
                          "disable_bias_linear": True, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16},
                         world_size=1)
    assert config.model.kv_lora_rank == 16
    fp8 = make_config({**BASE, "fp8_format": "e4m3", "bf16": True, "fp8_recipe": "rowwise"}).model
    assert fp8.fp8_recipe == "rowwise"
