"""The terms every kind's saved bytes are written in (here and in planning/activation_memory.py): the bytes of a
value, the tokens of one rank's micro-batch, a norm's saved tensors, the routed experts' tokens."""

from __future__ import annotations

from megatron_lite.config.sections import Config

FP32 = 4
INDEX = 8  # int64 token ids, labels and expert indices


def param_bytes(config: Config) -> int:
    """Bytes per model weight (and activation): 2 with --bf16/--fp16, else 4."""
    o = config.optimizer
    return 2 if (o.bf16 or o.fp16) else FP32


def expert_tensor_parallel_size(config: Config) -> int:
    """The ranks splitting each routed expert's weights: --expert-tensor-parallel-size, else TP (Megatron's)."""
    p = config.parallel
    return p.expert_tensor_parallel_size or p.tensor_model_parallel_size


def micro_batch_tokens(config: Config) -> tuple[int, int]:
    """Tokens of one micro-batch on one rank: (all local tokens, tokens of the residual stream)."""
    m, p, b = config.model, config.parallel, config.training.micro_batch_size
    tokens = m.seq_length // p.context_parallel_size * b
    return tokens, tokens // p.tensor_model_parallel_size if p.sequence_parallel else tokens


def norm_bytes(config: Config, e: int) -> int:
    """Per token, what a norm saves: RMSNorm its fp32 input and normalized value and a 4-byte rstd; LayerNorm its
    input and 8 bytes of mean and rstd."""
    h = config.model.hidden_size
    return 8 * h + FP32 if config.model.normalization == "RMSNorm" else e * h + 2 * FP32


def expert_region_tokens(config: Config) -> int:
    """Tokens of one micro-batch that a rank's routed experts serve (model/moe/layer.py's expert region): the ETP
    group's, all-gathered when its ranks hold different tokens (sequence parallelism, or ETP ranks that are not the
    rank's TP peers under folding), else the rank's own. With ETP = TP that is every local token."""
    p = config.parallel
    tokens, stream = micro_batch_tokens(config)
    etp = expert_tensor_parallel_size(config)
    return stream * etp if p.sequence_parallel or etp != p.tensor_model_parallel_size else tokens
