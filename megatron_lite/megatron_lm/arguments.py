"""Megatron-LM's saved flags (the checkpoint's `args` Namespace) <-> this framework's flags.

Most flags here are Megatron-LM's, with its names and meanings, so a flag the checkpoint was trained with
carries over as it is when this framework has it: the model's shape, the learning-rate and weight-decay
schedules, the optimizer's constants, the batch sizes and length of the run, precision, the data and the
tokenizer. The exceptions are translated:

  padded_vocab_size -> vocab_size     the rows Megatron stored (its padding joins the vocabulary here, so the
                                      softmax runs over the same rows as Megatron's and the loss is equal)
  add_bias_linear   -> disable_bias_linear (its negation)

A flag whose meaning here would differ, or that changes the network in a way this framework does not build
(`REFUSED`, when set to anything but Megatron's default), stops the conversion with one line, as do the
features whose Megatron tensors are not read yet (`NOT_READ`: multi-latent attention, multi-token
prediction). Every other flag (the layout, which a converted checkpoint does not need since it reshards;
kernels, logging, infrastructure) has no meaning here and is listed.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_lite.config.sections import Config
from megatron_lite.data.tokenizers import TOKENIZER_TYPES
from megatron_lite.errors import ConfigError

# Flags whose values would change the network or its training in ways this framework does not build, with
# the value that means "not used".
REFUSED = {
    "apply_layernorm_1p": False, "layernorm_zero_centered_gamma": False, "rotary_percent": 1.0,
    "rotary_interleaved": False, "squared_relu": False, "apply_residual_connection_post_layernorm": False,
    "experimental_attention_variant": None, "window_size": None, "softmax_type": "vanilla",
    "attention_output_gate": False, "heterogeneous_layers_config_path": None, "qk_l2_norm": False,
    "moe_use_legacy_grouped_gemm": False, "hybrid_override_pattern": None, "hybrid_layer_pattern": None,
    "is_hybrid_model": False,
}
# Features this framework builds whose Megatron-Core tensors it does not read yet: Megatron-Core's MLA has no
# layer spec without Transformer Engine to test the conversion against (its rotary layout is unverified).
NOT_READ = {"multi_latent_attention": False, "mtp_num_layers": None}
# Our fields that are choices of a run or of this framework, never read from Megatron's flags.
_NOT_CARRIED = {"model_preset", "attention_backend", "torch_compile", "recompute_granularity", "recompute_method",
                "recompute_num_layers", "vocab_size", "disable_bias_linear", "device", "mock_data"}
_CARRIED_SECTIONS = ("model", "optimizer", "training", "data")
_CHECKPOINT_FIELDS = ("save_interval",)
_LOGGING_FIELDS = ("log_interval",)


def _fields(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(getattr(Config(), section))]


def carried_names() -> list[str]:
    """Our flags (field names) read from a Megatron-LM checkpoint's args under the same name."""
    names = [name for section in _CARRIED_SECTIONS for name in _fields(section)]
    return [name for name in [*names, *_CHECKPOINT_FIELDS, *_LOGGING_FIELDS] if name not in _NOT_CARRIED]


@dataclasses.dataclass
class ArgsMapping:
    """Our flag values from a Megatron-LM checkpoint's args, and the Megatron flags left behind."""

    values: dict
    ignored: list[str]


def flags_from_megatron(args: argparse.Namespace | dict, source: str) -> ArgsMapping:
    """Our flag values carried from Megatron-LM's saved `args`; a refused flag is a ConfigError naming it."""
    given = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args)
    for name, unused in REFUSED.items():
        value = given.get(name, unused)
        if value != unused and not (isinstance(unused, float) and value is not None and float(value) == unused):
            raise ConfigError(f"{source} was trained with --{name.replace('_', '-')} {value}, which this framework "
                              f"does not build; it cannot be converted")
    for name, unused in NOT_READ.items():
        if given.get(name, unused) not in (unused, 0):
            raise ConfigError(f"{source} was trained with --{name.replace('_', '-')} {given[name]}: such checkpoints "
                              f"are not read from Megatron-LM's formats yet; export it to Hugging Face with "
                              f"Megatron-Bridge and convert with --direction hf-to-mlite")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size"):
        if given.get(name) is None:
            raise ConfigError(f"{source}: its saved args hold no {name}; is it a Megatron-LM GPT checkpoint?")
    values = {name: given[name] for name in carried_names() if given.get(name) is not None}
    values["vocab_size"] = int(given["padded_vocab_size"])
    values["disable_bias_linear"] = not given.get("add_bias_linear", True)
    dropped = set()
    if values.get("tokenizer_type") not in (None, *TOKENIZER_TYPES):  # e.g. GPT2BPETokenizer: pass another
        dropped = {"tokenizer_type", "tokenizer_model"}
        values = {name: value for name, value in values.items() if name not in dropped}
    used = {*(name for name in carried_names() if name in given), *REFUSED, "padded_vocab_size", "add_bias_linear"}
    used -= dropped
    return ArgsMapping(values, sorted(name for name in given if name not in used))


def megatron_args(config: Config, layout: dict, consumed_samples: int, iteration: int) -> argparse.Namespace:
    """A Megatron-LM args Namespace for a checkpoint of `config`: every carried flag under Megatron's name,
    the translated ones, and the target layout (`layout`: tensor/pipeline/expert_model_parallel_size)."""
    values = {}
    for name in carried_names():
        for section in (*_CARRIED_SECTIONS, "checkpoint", "logging"):
            target = getattr(config, section)
            if hasattr(target, name):
                values[name] = getattr(target, name)
                break
    m = config.model
    values.update(layout, padded_vocab_size=m.vocab_size, vocab_size=m.vocab_size,
                  add_bias_linear=not m.disable_bias_linear, consumed_train_samples=consumed_samples,
                  consumed_valid_samples=0, iteration=iteration, ckpt_format="torch_dist",
                  use_dist_ckpt=True)
    return argparse.Namespace(**values)
