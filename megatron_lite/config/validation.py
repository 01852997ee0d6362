"""Configuration checks: everything that can be verified before a process group exists.

Each `_*_problems` function returns one line per problem, saying what to change; `validate` raises them
together as one ConfigError, so a bad layout fails on every rank before any collective can hang.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import TYPE_CHECKING

from megatron_lite.config.attention_variants_validation import attention_variant_problems
from megatron_lite.config.fault_tolerance_validation import fault_tolerance_problems
from megatron_lite.config.flag_dependencies import dependency_problems
from megatron_lite.config.fp8_validation import fp8_problems
from megatron_lite.config.hybrid_layer_pattern import pattern_chunk_layers
from megatron_lite.config.kinds import KINDS
from megatron_lite.config.layer_pattern import moe_layer_pattern
from megatron_lite.config.layer_split import pipeline_stage_layers
from megatron_lite.config.mla_validation import mla_problems
from megatron_lite.config.moe_validation import expert_layout_problems
from megatron_lite.config.mtp_validation import mtp_problems
from megatron_lite.config.muon_validation import muon_problems
from megatron_lite.config.schedules import schedule_problems
from megatron_lite.config.sft import sft_problems
from megatron_lite.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from megatron_lite.config.sections import Config


def validate(config: Config, world_size: int, given: Iterable[str] = ()) -> None:
    """Check everything that can be checked before a process group exists; raise one ConfigError. `given` names
    the flags the command line, YAML file or preset set, for the table of what each flag needs."""
    problems = dependency_problems(config, given) + _value_problems(config) + muon_problems(config)
    problems += mla_problems(config)
    if not problems:  # the checks below divide by sizes that must first be known to be positive
        problems = (_layout_problems(config, world_size) + _model_problems(config) + _run_problems(config)
                    + schedule_problems(config) + _profile_problems(config, world_size)
                    + fp8_problems(config) + mtp_problems(config) + attention_variant_problems(config)
                    + [problem for kind in KINDS if kind.problems for problem in kind.problems(config)])
    if problems:
        raise ConfigError("; ".join(problems))


# The bounds of single values, each checked here only: the other validators check how values relate. The
# smallest value of each count or size flag; an unset (None) optional flag is not checked.
_INT_MINIMUMS = {
    "num_layers": 1, "hidden_size": 1, "ffn_hidden_size": 1, "num_attention_heads": 1, "num_query_groups": 1,
    "seq_length": 1, "max_position_embeddings": 1, "vocab_size": 2, "make_vocab_size_divisible_by": 1,
    "num_experts": 1, "moe_router_topk": 1, "moe_ffn_hidden_size": 1, "moe_layer_freq": 1,
    "moe_router_num_groups": 1, "moe_router_group_topk": 1, "moe_shared_expert_intermediate_size": 1,
    "moe_latent_size": 1,
    "recompute_num_layers": 1, "tensor_model_parallel_size": 1, "context_parallel_size": 1,
    "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
    "num_layers_per_virtual_pipeline_stage": 1,
    "num_virtual_stages_per_pipeline_rank": 1, "num_distributed_optimizer_instances": 1,
    "decoder_first_pipeline_num_layers": 0, "decoder_last_pipeline_num_layers": 0,
    "lr_warmup_iters": 0, "lr_decay_iters": 1, "loss_scale_window": 1, "hysteresis": 1, "num_workers": 0,
    "ddp_bucket_size": 1,
    "micro_batch_size": 1, "global_batch_size": 1, "train_iters": 1, "eval_interval": 1, "eval_iters": 0,
    "eval_task_limit": 1,
    "seed": 0, "exit_interval": 1, "save_interval": 1, "keep_last_n": 1, "ckpt_step": 0, "log_interval": 1,
    "tensorboard_log_interval": 1, "train_samples": 1, "lr_warmup_samples": 0, "lr_decay_samples": 1,
    "lr_wsd_decay_iters": 1, "lr_wsd_decay_samples": 1, "profile_step_start": 0, "profile_step_end": 1,
    "kv_channels": 1, "rope_scaling_original_max_position_embeddings": 1, "mtp_num_layers": 1,
    "straggler_minmax_count": 1, "linear_attention_freq": 1, "linear_conv_kernel_dim": 1, "linear_key_head_dim": 1,
    "linear_value_head_dim": 1, "linear_num_key_heads": 1, "linear_num_value_heads": 1,
    "kv_lora_rank": 1, "q_lora_rank": 1, "qk_head_dim": 1, "qk_pos_emb_head_dim": 1, "v_head_dim": 1,
    "yarn_original_max_position_embeddings": 1, "muon_num_ns_steps": 1,
    **{name: least for kind in KINDS for name, least in kind.minimums.items()},
}
_POSITIVE_FLOATS = {"rotary_base", "activation_func_clamp_value", "norm_epsilon", "moe_expert_capacity_factor",
                    "moe_router_topk_scaling_factor",
                    "moe_router_bias_update_rate", "loss_scale", "initial_loss_scale",
                    "min_loss_scale", "exit_duration_in_mins", "distributed_timeout_minutes", "peak_tflops",
                    "rope_scaling_factor", "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                    "rotary_scaling_factor", "yarn_beta_slow", "muon_extra_scale_factor"}
_NON_NEGATIVE_FLOATS = {"lr", "min_lr", "weight_decay", "adam_eps", "clip_grad", "init_method_std",
                        "moe_aux_loss_coeff", "moe_z_loss_coeff", "lr_warmup_init", "start_weight_decay",
                        "end_weight_decay", "hang_timeout_seconds", "mscale", "mscale_all_dim",
                        "mtp_loss_scaling_factor"}
_FRACTIONS = {"hidden_dropout", "attention_dropout", "adam_beta1", "adam_beta2", "lr_warmup_fraction",
              "muon_momentum"}  # in [0, 1)


def _router_problems(m) -> list[str]:
    """The MoE router's group-limited routing: sizes that fit the experts and the top k."""
    problems = []
    groups, group_topk, topk = m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk
    if (groups is None) != (group_topk is None):
        problems.append("--moe-router-num-groups and --moe-router-group-topk go together; give both or neither")
    elif groups is not None:
        if m.num_experts % groups:
            problems.append(f"moe-router-num-groups ({groups}) must divide num-experts ({m.num_experts})")
        elif group_topk > groups:
            problems.append(f"moe-router-group-topk ({group_topk}) must not exceed moe-router-num-groups ({groups})")
        elif topk % group_topk:
            problems.append(f"moe-router-group-topk ({group_topk}) must divide moe-router-topk ({topk})")
        elif topk // group_topk > m.num_experts // groups:
            problems.append(f"moe-router-topk / moe-router-group-topk ({topk // group_topk}) must not exceed the "
                            f"experts per group ({m.num_experts // groups})")
    return problems


def _value_problems(config: Config) -> list[str]:
    """Numbers outside what their flag can mean: every float must be finite (a NaN or infinite lr or
    epsilon trains NaN to the end), counts and sizes at least their minimum, rates and betas in [0, 1)."""
    problems = []
    for section in dataclasses.fields(config):
        for f in dataclasses.fields(getattr(config, section.name)):
            value, flag = getattr(getattr(config, section.name), f.name), f.name.replace("_", "-")
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{flag} ({value}) must be a finite number")
            elif f.name in _INT_MINIMUMS and value < _INT_MINIMUMS[f.name]:
                problems.append(f"{flag} ({value}) must be at least {_INT_MINIMUMS[f.name]}")
            elif f.name in _POSITIVE_FLOATS and value <= 0:
                problems.append(f"{flag} ({value}) must be positive")
            elif f.name in _NON_NEGATIVE_FLOATS and value < 0:
                problems.append(f"{flag} ({value}) must not be negative")
            elif f.name in _FRACTIONS and not 0 <= value < 1:
                problems.append(f"{flag} ({value}) must be at least 0 and below 1")
    return problems


def _layout_problems(config: Config, world_size: int) -> list[str]:
    m, p = config.model, config.parallel
    tp, cp, pp = p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size
    problems = []
    if world_size % (tp * cp * pp):
        problems.append(
            f"world size ({world_size}) must be divisible by tensor-model-parallel-size ({tp}) x "
            f"context-parallel-size ({cp}) x pipeline-model-parallel-size ({pp}) = {tp * cp * pp}; "
            f"change the layout or the number of processes")
        return problems
    dp = p.data_parallel_size
    if m.num_attention_heads % tp:
        problems.append(f"num-attention-heads ({m.num_attention_heads}) must be divisible by "
                        f"tensor-model-parallel-size ({tp})")
    if m.num_query_groups % tp:
        problems.append(f"num-query-groups ({m.num_query_groups}) must be divisible by "
                        f"tensor-model-parallel-size ({tp})")
    dense_mlp = not all(moe_layer_pattern(m))
    if dense_mlp and m.ffn_hidden_size % tp:
        problems.append(f"ffn-hidden-size ({m.ffn_hidden_size}) must be divisible by "
                        f"tensor-model-parallel-size ({tp})")
    if p.sequence_parallel and (m.seq_length // cp) % tp:
        problems.append(f"seq-length / context-parallel-size ({m.seq_length // cp}) must be divisible by "
                        f"tensor-model-parallel-size ({tp}) with --sequence-parallel")
    if cp > 1 and m.seq_length % (2 * cp):
        problems.append(f"seq-length ({m.seq_length}) must be divisible by 2 x context-parallel-size "
                        f"({2 * cp}) for load-balanced context parallelism")
    if cp > 1 and m.attention_dropout > 0:
        problems.append(f"attention-dropout ({m.attention_dropout}) must be 0 with context-parallel-size > 1 "
                        f"(ring attention has no dropout); pass --attention-dropout 0")
    instances = p.num_distributed_optimizer_instances
    if (dp * cp) % instances:
        problems.append(f"num-distributed-optimizer-instances ({instances}) must divide data-parallel x "
                        f"context-parallel size ({dp} x {cp} = {dp * cp})")
    problems += expert_layout_problems(config)
    if p.pipeline_schedule == "zb-h1" and p.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params"):
        problems.append(f"--pipeline-schedule zb-h1 cannot be combined with --data-parallel-sharding-strategy "
                        f"{p.data_parallel_sharding_strategy}: ZeRO-2/3 reduce gradients after every autograd call "
                        f"and zb-h1 runs one per weight group; use --use-distributed-optimizer (ZeRO-1) or 1f1b")
    if p.pipeline_schedule == "zb-h1" and m.recompute_granularity == "full":
        problems.append("--pipeline-schedule zb-h1 cannot be combined with --recompute-granularity full: every "
                        "weight group's pass would recompute its layer's forward; use selective or 1f1b")
    if p.pipeline_schedule == "zb-h1" and m.torch_compile:
        problems.append("--pipeline-schedule zb-h1 cannot be combined with --torch-compile: a compiled layer's "
                        "backward frees its buffers as it runs, and zb-h1 keeps the graph from B to W; use 1f1b")
    problems += _pipeline_split_problems(config) + _context_parallel_problems(config)
    return problems


def _pipeline_split_problems(config: Config) -> list[str]:
    p = config.parallel
    pp = p.pipeline_model_parallel_size
    if pp == 1:
        return []
    staged = pattern_chunk_layers(config) is not None
    problems = [] if staged else _even_split_problems(config)
    if problems:
        return problems
    if config.virtual_pipeline_stages is not None and p.pipeline_schedule != "1f1b":
        virtual = ("the | segments of --hybrid-layer-pattern beyond one per stage" if staged else
                   "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
        return [f"--pipeline-schedule {p.pipeline_schedule} has no interleaved form; drop {virtual} or use 1f1b"]
    if config.virtual_pipeline_stages is not None and config.num_microbatches % pp:
        return [f"number of micro-batches ({config.num_microbatches}) must be divisible by "
                f"pipeline-model-parallel-size ({pp}) for the interleaved schedule"]
    return []


def _even_split_problems(config: Config) -> list[str]:
    """Without --hybrid-layer-pattern's | stages: whether --num-layers splits over the (virtual) stages."""
    m, p = config.model, config.parallel
    pp = p.pipeline_model_parallel_size
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    middle_stages = pp - (first is not None) - (last is not None)
    remaining = m.num_layers - (first or 0) - (last or 0)
    if middle_stages < 0 or remaining < 0 or (middle_stages == 0 and remaining != 0):
        return [f"cannot split num-layers ({m.num_layers}) into {pp} pipeline stages with first="
                f"{first} and last={last}; the counts must add up to num-layers"]
    if middle_stages and (remaining % middle_stages or remaining == 0):
        return [f"num-layers ({m.num_layers}) cannot be split evenly over {pp} pipeline stages; set "
                f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"]
    vp_layers, vp_stages = p.num_layers_per_virtual_pipeline_stage, p.num_virtual_stages_per_pipeline_rank
    if vp_layers is not None:
        if first is not None or last is not None:
            return ["--num-layers-per-virtual-pipeline-stage cannot be combined with an uneven split; use "
                    "--num-virtual-stages-per-pipeline-rank"]
        per_stage = m.num_layers // pp
        if per_stage % vp_layers:
            return [f"layers per pipeline stage ({per_stage}) must be divisible by "
                    f"num-layers-per-virtual-pipeline-stage ({vp_layers})"]
    if vp_stages is not None:
        uneven = [(stage, n) for stage, n in enumerate(pipeline_stage_layers(config)) if n % vp_stages]
        if uneven:
            stage, n = uneven[0]
            return [f"layers of pipeline stage {stage} ({n}) must be divisible by "
                    f"num-virtual-stages-per-pipeline-rank ({vp_stages})"]
    return []


def _context_parallel_problems(config: Config) -> list[str]:
    """--cp-comm-type a2a splits each tensor-parallel rank's query heads over the cp ranks, a2a+p2p over the A
    ranks of --hierarchical-context-parallel-sizes A B (A x B = cp): they must divide."""
    m, p = config.model, config.parallel
    cp, heads = p.context_parallel_size, m.num_attention_heads // p.tensor_model_parallel_size
    sizes = p.hierarchical_context_parallel_sizes
    if p.cp_comm_type != "a2a+p2p":
        if p.cp_comm_type != "a2a" or heads % cp == 0:
            return []
        return [f"num-attention-heads per tensor-parallel rank ({heads}) must be divisible by context-parallel-size "
                f"({cp}) with --cp-comm-type a2a"]
    if sizes is None:
        return ["--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B"]
    a2a, p2p = sizes
    if a2a < 1 or p2p < 1 or a2a * p2p != cp:
        return [f"hierarchical-context-parallel-sizes A x B ({a2a} x {p2p}) must equal context-parallel-size ({cp})"]
    if heads % a2a:
        return [f"num-attention-heads per tensor-parallel rank ({heads}) must be divisible by the a2a size A "
                f"({a2a}) of --hierarchical-context-parallel-sizes"]
    return []


def _model_problems(config: Config) -> list[str]:
    m = config.model
    problems = []
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        problems.append(f"hidden-size ({m.hidden_size}) must be divisible by num-attention-heads "
                        f"({m.num_attention_heads})")
    if m.num_attention_heads % m.num_query_groups:
        problems.append(f"num-attention-heads ({m.num_attention_heads}) must be divisible by "
                        f"num-query-groups ({m.num_query_groups})")
    if m.position_embedding_type == "learned_absolute" and m.seq_length > m.max_position_embeddings:
        problems.append(f"seq-length ({m.seq_length}) exceeds max-position-embeddings "
                        f"({m.max_position_embeddings}) with learned positions; raise "
                        f"--max-position-embeddings or shorten --seq-length")
    if m.rotary_position_embeddings and m.head_dim % 2:
        problems.append(f"rope needs an even head dimension, got {m.head_dim}")
    problems += _rope_scaling_problems(m)
    if m.num_experts:
        if m.moe_router_topk > m.num_experts:
            problems.append(f"moe-router-topk ({m.moe_router_topk}) must not exceed num-experts "
                            f"({m.num_experts})")
        if not m.disable_bias_linear and m.moe_shared_expert_intermediate_size:
            problems.append("the shared expert has no biases: pass --disable-bias-linear with "
                            "--moe-shared-expert-intermediate-size")
        problems += _router_problems(m)
    if m.recompute_method is not None and m.recompute_num_layers is None:
        problems.append(f"--recompute-method {m.recompute_method} needs --recompute-num-layers")
    return problems


def _rope_scaling_problems(m) -> list[str]:
    """--use-rope-scaling rescales rotary frequencies in a band between its two wavelengths."""
    if not m.use_rope_scaling:
        return []
    if m.rope_scaling_high_freq_factor <= m.rope_scaling_low_freq_factor:
        return [f"rope-scaling-high-freq-factor ({m.rope_scaling_high_freq_factor}) must exceed "
                f"rope-scaling-low-freq-factor ({m.rope_scaling_low_freq_factor})"]
    return []


def _run_problems(config: Config) -> list[str]:
    m, p, t, o, d = config.model, config.parallel, config.training, config.optimizer, config.data
    problems = []
    per_step = t.micro_batch_size * p.data_parallel_size
    if t.global_batch_size % per_step:
        problems.append(f"global-batch-size ({t.global_batch_size}) must be divisible by micro-batch-size "
                        f"({t.micro_batch_size}) x data-parallel size ({p.data_parallel_size}) = {per_step}")
    problems += _data_source_problems(config)
    problems += _raw_text_problems(config)
    if config.logging.tensorboard_dir and importlib.util.find_spec("tensorboard") is None:
        problems.append("--tensorboard-dir needs the tensorboard package: pip install 'megatron-lite[tensorboard]'")
    if d.mock_data and not m.vocab_size:
        problems.append("--mock-data needs --vocab-size (or a --model-preset that sets it)")
    if not d.mock_data and d.tokenizer_type == "NullTokenizer" and not m.vocab_size:
        problems.append("--tokenizer-type NullTokenizer needs --vocab-size (the number of token ids in the data)")
    if not d.mock_data and d.tokenizer_type != "NullTokenizer" and not d.tokenizer_model:
        problems.append(f"--tokenizer-type {d.tokenizer_type} needs --tokenizer-model PATH")
    if o.min_lr > o.lr:
        problems.append(f"min-lr ({o.min_lr}) must not exceed lr ({o.lr})")
    problems += _optimizer_problems(config)
    problems += _document_problems(config)
    problems += sft_problems(config)
    problems += fault_tolerance_problems(config)
    if t.hang_timeout_seconds and t.hang_timeout_seconds >= 60 * t.distributed_timeout_minutes:
        problems.append(f"--hang-timeout-seconds ({t.hang_timeout_seconds:g}) must be below the process-group "
                        f"timeout, --distributed-timeout-minutes x 60 ({60 * t.distributed_timeout_minutes:g}): "
                        f"the report must come before the timeout ends the ranks")
    return problems


def _data_source_problems(config: Config) -> list[str]:
    """One source of training data, as in Megatron: --mock-data, one blend cut by --split
    (--data-path or --data-args-path), or a corpus per split (--train-data-path, with optional
    --valid-data-path and --test-data-path)."""
    d = config.data
    blend = [flag for flag, value in (("--data-path", d.data_path), ("--data-args-path", d.data_args_path))
             if value]
    per_split = [f"--{name}-data-path" for name in ("train", "valid", "test") if getattr(d, f"{name}_data_path")]
    if d.mock_data:
        return []
    if len(blend) > 1:
        return ["give --data-path or --data-args-path (a file of the same words), not both"]
    if blend and per_split:
        return [f"{blend[0]} (cut by --split) and {', '.join(per_split)} (a corpus per split) exclude each other; "
                f"use one or the other"]
    if not blend and not per_split:
        return ["no training data: pass --data-path PREFIX (see tools/preprocess_data.py), --data-args-path FILE, "
                "--train-data-path PREFIX or --mock-data"]
    return []


def _raw_text_problems(config: Config) -> list[str]:
    """What training from raw text needs: one text key (preprocessing writes one dataset per key; a run reads
    one), a non-negative bad-record allowance, and chunks of a positive size."""
    d = config.data
    problems = []
    if len(d.json_keys) != 1:
        problems.append(f"--json-keys takes one key when training ({' '.join(d.json_keys)} given): name the column "
                        f"holding the text")
    if d.skip_bad_records < 0:
        problems.append(f"skip-bad-records ({d.skip_bad_records}) must be >= 0")
    if not d.raw_text_chunk_mib > 0:
        problems.append(f"raw-text-chunk-mib ({d.raw_text_chunk_mib}) must be a positive number of MiB")
    return problems


def _document_problems(config: Config) -> list[str]:
    """What --reset-attention-mask and --sft (a document per conversation) cannot run with: flash-attn (its varlen
    kernel is not wired in) and attention dropout (FlexAttention, the CUDA path, has none)."""
    m, d = config.model, config.data
    if not (d.reset_attention_mask or d.sft):
        return []
    flag = "--reset-attention-mask" if d.reset_attention_mask else "--sft"
    problems = []
    if m.attention_backend == "flash":
        problems.append(f"{flag} runs through SDPA/FlexAttention, not flash-attn: use "
                        f"--attention-backend auto or sdpa")
    if m.attention_dropout > 0:
        problems.append(f"attention-dropout ({m.attention_dropout}) must be 0 with {flag} "
                        f"(FlexAttention has no dropout); pass --attention-dropout 0")
    return problems


def _optimizer_problems(config: Config) -> list[str]:
    o = config.optimizer
    if not 0 <= o.optimizer_offload_fraction <= 1:
        return [f"--optimizer-offload-fraction ({o.optimizer_offload_fraction}) must be between 0 and 1"]
    return []


def _profile_problems(config: Config, world_size: int) -> list[str]:
    log = config.logging
    if not log.profile:
        return []
    problems = []
    if log.profile_step_end <= log.profile_step_start:
        problems.append(f"profile-step-end ({log.profile_step_end}) must be after profile-step-start "
                        f"({log.profile_step_start})")
    outside = [rank for rank in log.profile_ranks if not 0 <= rank < world_size]
    if outside:
        problems.append(f"profile-ranks {outside} are not ranks of this run (world size {world_size})")
    return problems
