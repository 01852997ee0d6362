"""Which flags act only beside another, and which exclude each other: one table over every flag of the parser.

A flag typed without what gives it meaning (`--kv-lora-rank` without `--multi-latent-attention`,
`--fp8-recipe` without `--fp8-format`) would otherwise be accepted and change nothing, and the run would train
something other than what its command line says. Megatron-LM ignores many such flags without a word; here each one
is refused with one line naming both flags (docs/flags.md lists the rules).

Every flag has an entry: the conditions it needs (`Needs`, `Excludes`), or a place in `STANDS_ALONE`, which says
it means the same whatever else is set. tests/test_flag_dependencies.py fails on a flag of the parser without one.
A flag counts as given when the command line, the YAML file or the model preset sets it to a value other than
unset or false; the conditions are read off the finished configuration (defaults filled in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_lite.config.kinds import KINDS

if TYPE_CHECKING:
    from collections.abc import Iterable

    from megatron_lite.config.sections import Config


@dataclass(frozen=True)
class Needs:
    """The flag acts only when one of `flags` is on: set to one of `values` when they are given, above `above`
    when that is given, else to anything but unset, false, 0 or empty. `says` names the condition where the
    flags' names would not say it."""

    flags: tuple[str, ...]
    values: tuple = ()
    above: int | None = None
    says_instead: str = ""

    def holds(self, settings: dict) -> bool:
        return any(self._on(settings[flag]) for flag in self.flags)

    def _on(self, value) -> bool:
        if self.values:
            return value in self.values
        if self.above is not None:
            return value is not None and value > self.above
        return value not in (None, False, 0, "", [])

    def says(self) -> str:
        if self.says_instead:
            return self.says_instead
        names = " or ".join(_flag(flag) for flag in self.flags)
        if self.values:
            return f"{names} {' or '.join(str(value) for value in self.values)}"
        return f"{names} above {self.above}" if self.above is not None else names


@dataclass(frozen=True)
class Excludes:
    """The flag and `flag` cannot both be on: one of them would be ignored."""

    flag: str

    def holds(self, settings: dict) -> bool:
        return settings[self.flag] in (None, False, [])


@dataclass(frozen=True)
class PatternPlaces(Needs):
    """The flag acts only when --hybrid-layer-pattern writes `symbol`: the flags of a kind only the pattern places
    (config/kinds/)."""

    symbol: str = ""

    def _on(self, value) -> bool:
        return self.symbol in (value or "")


def pattern_places(symbol: str) -> PatternPlaces:
    return PatternPlaces(("hybrid_layer_pattern",), says_instead=f"--hybrid-layer-pattern writing {symbol} layers",
                         symbol=symbol)


@dataclass(frozen=True)
class AnyOf:
    """The flag acts when any of `conditions` holds."""

    conditions: tuple[Needs, ...]

    @property
    def flags(self) -> tuple[str, ...]:
        return tuple(flag for condition in self.conditions for flag in condition.flags)

    def holds(self, settings: dict) -> bool:
        return any(condition.holds(settings) for condition in self.conditions)

    def says(self) -> str:
        return " or ".join(condition.says() for condition in self.conditions)


def needs(*flags: str, values: tuple = (), above: int | None = None, says: str = "") -> Needs:
    return Needs(flags, values, above, says)


_SHARDED = needs("data_parallel_sharding_strategy", values=("optim", "optim_grads", "optim_grads_params"),
                 says="--use-distributed-optimizer (or a --data-parallel-sharding-strategy other than no_shard)")
_MOE = needs("num_experts")
_MLA = needs("multi_latent_attention")
_ROTARY = needs("position_embedding_type", values=("rope", "yarn"))
_YARN = AnyOf((_MLA, needs("position_embedding_type", values=("yarn",))))
_LINEAR_ATTENTION = needs("experimental_attention_variant")
_FP8 = needs("fp8_format")
_PP = needs("pipeline_model_parallel_size", above=1)
_FP16 = needs("fp16")
_MUON = needs("optimizer", values=("muon",))
_WSD = needs("lr_decay_style", values=("WSD",))
_SAMPLES = needs("train_samples")
_ITERATIONS = Excludes("train_samples")
_ROPE_SCALING = needs("use_rope_scaling")
_TENSORBOARD = needs("tensorboard_dir")
_PROFILE = needs("profile")
_LOAD = needs("load")
_SAVE = needs("save")
_CORPUS = Excludes("mock_data")
_FT = needs("fault_tolerance")

RULES: dict[str, tuple[Needs | AnyOf | Excludes, ...]] = {
    **{name: (_FT,) for name in ("ft_replica_id", "ft_num_replica_groups", "ft_min_replica_size", "ft_lighthouse")},
    # model
    "num_query_groups": (needs("group_query_attention"),),
    "openai_gelu": (Excludes("swiglu"),),
    "squared_relu": (Excludes("swiglu"), Excludes("openai_gelu")),
    "quick_geglu": (Excludes("swiglu"),),
    **{name: (needs("swiglu", "quick_geglu"),) for name in ("glu_linear_offset", "activation_func_clamp_value")},
    "rotary_base": (_ROTARY,),
    "add_qkv_bias": (needs("disable_bias_linear"),),
    "use_rope_scaling": (needs("position_embedding_type", values=("rope",)),),
    "rotary_percent": (_ROTARY,),
    "rope_scaling_factor": (_ROPE_SCALING,),
    "rope_scaling_low_freq_factor": (_ROPE_SCALING,),
    "rope_scaling_high_freq_factor": (_ROPE_SCALING,),
    "rope_scaling_original_max_position_embeddings": (_ROPE_SCALING,),
    **{name: (_MLA,) for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")},
    **{name: (_YARN,) for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim",
                                   "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow")},
    **{name: (_MOE,) for name in ("moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                                  "moe_expert_capacity_factor", "moe_layer_freq", "moe_token_dispatcher_type",
                                  "moe_router_score_function", "moe_router_topk_scaling_factor",
                                  "moe_router_load_balancing_type", "moe_router_num_groups",
                                  "moe_shared_expert_intermediate_size", "moe_latent_size",
                                  "expert_model_parallel_size", "expert_tensor_parallel_size")},
    **{name: (_LINEAR_ATTENTION,) for name in ("linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
                                               "linear_value_head_dim", "linear_num_key_heads",
                                               "linear_num_value_heads")},
    **{f.name: (pattern_places(kind.symbol),) for kind in KINDS if kind.section
       for f in dataclasses.fields(kind.section)},
    "window_attn_skip_freq": (needs("window_size"),),
    "moe_router_pre_softmax": (_MOE, needs("moe_router_score_function", values=("softmax",))),
    "moe_router_enable_expert_bias": (_MOE, needs("moe_router_score_function", values=("sigmoid",))),
    "moe_router_bias_update_rate": (needs("moe_router_enable_expert_bias"),),
    "moe_router_group_topk": (needs("moe_router_num_groups"),),
    "moe_shared_expert_gate": (needs("moe_shared_expert_intermediate_size"),),
    "fp8_recipe": (_FP8,),
    "fp8_margin": (_FP8,),
    "first_last_layers_bf16": (_FP8,),
    "num_layers_at_start_in_bf16": (needs("first_last_layers_bf16"),),
    "num_layers_at_end_in_bf16": (needs("first_last_layers_bf16"),),
    "mtp_loss_scaling_factor": (needs("mtp_num_layers"),),
    "recompute_method": (needs("recompute_granularity", values=("full",)),),
    "recompute_num_layers": (needs("recompute_granularity", values=("full",)),),
    # parallel
    "sequence_parallel": (needs("tensor_model_parallel_size", above=1),),
    "num_layers_per_virtual_pipeline_stage": (_PP, Excludes("num_virtual_stages_per_pipeline_rank")),
    "num_virtual_stages_per_pipeline_rank": (_PP,),
    "decoder_first_pipeline_num_layers": (_PP,),
    "decoder_last_pipeline_num_layers": (_PP,),
    "pipeline_schedule": (_PP,),
    "cp_comm_type": (needs("context_parallel_size", above=1),),
    "hierarchical_context_parallel_sizes": (needs("cp_comm_type", values=("a2a+p2p",)),),
    "overlap_param_gather": (_SHARDED,),
    "num_distributed_optimizer_instances": (_SHARDED,),
    # optimizer
    "lr_warmup_iters": (_ITERATIONS,),
    "lr_warmup_samples": (_SAMPLES,),
    "lr_warmup_fraction": (Excludes("lr_warmup_iters"), Excludes("lr_warmup_samples")),
    "lr_decay_iters": (_ITERATIONS,),
    "lr_decay_samples": (_SAMPLES,),
    "lr_wsd_decay_style": (_WSD,),
    "lr_wsd_decay_iters": (_WSD, _ITERATIONS),
    "lr_wsd_decay_samples": (_WSD, _SAMPLES),
    "start_weight_decay": (needs("weight_decay_incr_style", values=("linear", "cosine")),),
    "end_weight_decay": (needs("weight_decay_incr_style", values=("linear", "cosine")),),
    "bf16": (Excludes("fp16"),),
    "loss_scale": (_FP16,),
    **{name: (_FP16, Excludes("loss_scale")) for name in ("initial_loss_scale", "min_loss_scale",
                                                          "loss_scale_window", "hysteresis")},
    "optimizer_offload_fraction": (needs("optimizer_cpu_offload"),),
    **{name: (_MUON,) for name in ("muon_momentum", "muon_nesterov", "muon_scale_mode", "muon_num_ns_steps",
                                   "muon_coefficient_type", "muon_tp_mode", "muon_extra_scale_factor",
                                   "muon_scalar_optimizer", "muon_no_split_qkv")},
    # data
    "data_path": (_CORPUS,),
    "data_args_path": (_CORPUS,),
    "split": (needs("data_path", "data_args_path"), _CORPUS),
    "train_data_path": (_CORPUS,),
    "valid_data_path": (needs("train_data_path"), _CORPUS),
    "test_data_path": (needs("train_data_path"), _CORPUS),
    "tokenizer_model": (needs("tokenizer_type", values=("SentencePieceTokenizer", "HuggingFaceTokenizer")),),
    # training
    "rampup_batch_size": (_SAMPLES,),
    "train_iters": (_ITERATIONS,),
    # checkpoint
    "save_interval": (_SAVE,),
    "async_save": (_SAVE,),
    "keep_last_n": (_SAVE,),
    "no_load_optim": (_LOAD,),
    "no_load_rng": (_LOAD,),
    "finetune": (_LOAD,),
    "ckpt_step": (_LOAD,),
    # logging
    "tensorboard_log_interval": (_TENSORBOARD,),
    "log_timers_to_tensorboard": (_TENSORBOARD,),
    "log_memory_to_tensorboard": (_TENSORBOARD,),
    "use_pytorch_profiler": (_PROFILE,),
    "profile_step_start": (_PROFILE,),
    "profile_step_end": (_PROFILE,),
    "profile_dir": (_PROFILE,),
    "profile_ranks": (needs("profile", "record_memory_history"),),
    "memory_snapshot_path": (needs("record_memory_history"),),
    "straggler_minmax_count": (needs("log_straggler"),),
    "eval_task_limit": (needs("eval_tasks"),),
    "sft": (_CORPUS, Excludes("reset_position_ids"), Excludes("reset_attention_mask"), Excludes("eod_mask_loss")),
    **{name: (needs("sft"),) for name in ("sft_tokenizer_prompt_format", "sft_long_conversations")},
}

# Flags that mean the same whatever else is given.
STANDS_ALONE = frozenset({
    "num_layers", "hybrid_layer_pattern", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "group_query_attention", "seq_length", "max_position_embeddings", "normalization", "norm_epsilon", "swiglu",
    "position_embedding_type", "kv_channels",
    "qk_layernorm", "multi_latent_attention", "untie_embeddings_and_output_weights", "disable_bias_linear",
    "hidden_dropout", "attention_dropout", "init_method_std", "make_vocab_size_divisible_by", "model_preset",
    "num_experts", "fp8_format", "mtp_num_layers", "experimental_attention_variant", "attention_output_gate",
    "apply_layernorm_1p", "window_size", "softmax_type", "recompute_granularity",
    "attention_backend", "torch_compile",
    # --vocab-size sizes --mock-data and NullTokenizer corpora; with a tokenizer its vocabulary wins (presets set it)
    "vocab_size",
    "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
    "use_distributed_optimizer", "overlap_grad_reduce", "ddp_bucket_size", "data_parallel_sharding_strategy",
    "lr", "min_lr", "lr_warmup_init", "lr_decay_style", "weight_decay", "weight_decay_incr_style", "adam_beta1",
    "adam_beta2", "adam_eps", "clip_grad", "fp16", "check_for_nan_in_loss_and_grad", "optimizer_cpu_offload",
    "optimizer",
    # raw-text options: whether --data-path names raw text is known only once its files are opened
    "json_keys", "skip_bad_records", "raw_text_chunk_mib",
    "mmap_bin_files", "mock_data", "tokenizer_type", "num_workers", "data_cache_path", "reset_position_ids",
    "reset_attention_mask", "eod_mask_loss",
    "micro_batch_size", "global_batch_size", "train_samples", "eval_interval", "eval_iters", "eval_tasks",
    "calculate_per_token_loss",
    # --no-yarn-correction-range-round-to-int changes nothing without YaRN, and its default is on
    "yarn_correction_range_round_to_int",
    "fault_tolerance",
    "seed", "device", "exit_signal_handler", "exit_interval", "exit_duration_in_mins", "distributed_timeout_minutes",
    "hang_timeout_seconds",
    "rerun_mode", "check_for_spiky_loss", "check_for_large_grads", "result_rejected_tracker_filename",
    "save", "load",
    # --wandb-exp-name and --wandb-save-dir also serve a project named by $WANDB_PROJECT
    "log_interval", "wandb_project", "wandb_exp_name", "wandb_save_dir", "tensorboard_dir", "metrics_jsonl",
    "peak_tflops", "debug", "profile", "record_memory_history", "log_straggler",
})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _settings(config: Config) -> dict:
    """Every field's value by name, after defaults were filled in."""
    return {f.name: getattr(getattr(config, section.name), f.name)
            for section in dataclasses.fields(config) for f in dataclasses.fields(getattr(config, section.name))}


def given_flags(values: dict) -> set[str]:
    """The flags among `values` (field names) set to something: unset (None) and false leave a flag out."""
    return {name for name, value in values.items() if value is not None and value is not False}


def acting_flags(config: Config, names: Iterable[str]) -> list[str]:
    """The flags among `names` that act in `config`: set to something, and every condition of theirs holding (what
    a configuration file written from `config` should name, so that it reads back without a refusal)."""
    settings = _settings(config)
    given = given_flags({name: settings[name] for name in names})
    return [name for name in names if name in given and all(rule.holds(settings) for rule in RULES.get(name, ()))]


def dependency_problems(config: Config, given: Iterable[str]) -> list[str]:
    """One line for each condition of a given flag that does not hold."""
    settings = _settings(config)
    problems = []
    for name in sorted(set(given) & RULES.keys()):
        for rule in RULES[name]:
            if rule.holds(settings):
                continue
            if isinstance(rule, Excludes):
                problems.append(f"{_flag(name)} and {_flag(rule.flag)} exclude each other (one would be ignored); "
                                f"give one of them")
            else:
                problems.append(f"{_flag(name)} acts only with {rule.says()}; add that or drop {_flag(name)}")
    return problems
