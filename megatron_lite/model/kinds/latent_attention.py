"""Multi-latent attention (model/attention/mla.py), DeepSeek-V2/V3's.

Saved per token beyond its input, with e the bytes of an activation and nh the rank's heads: the input e h; per
latent (query, with --q-lora-rank, and key/value) the norm's (as a layer norm's, model/kinds/activation_terms.py) and
the up-projection's input e r (in fp32 the key/value norm's input is a view that keeps the whole down-projection
output); the query and the key of e nh (qk_head_dim + qk_pos_emb_head_dim) each; the up-projection's output
e nh (qk_head_dim + v_head_dim), which the value heads keep alive (with padded heads, the padded value
e nh max(dims) instead); the attention output e nh v_head_dim and the log-sum-exp. These are the tensors fused
kernels save; the CPU's SDPA math path (different query-key and value head sizes) also saves the [s, s]
probabilities, so tests/test_mla.py checks the formula against the tensors autograd saves with the core attention
recomputed (selective), which saves only its inputs; the kernels' own saves are not checked.
"""

from __future__ import annotations

from megatron_lite.config.layer_specs import LayerSpec
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.model.attention.mla import MultiLatentAttention
from megatron_lite.model.kinds.activation_terms import FP32, micro_batch_tokens, param_bytes
from megatron_lite.model.kinds.kind import Kind


def build(config, pstate, number, spec, parts):
    return MultiLatentAttention(config, pstate, sequence_parallel=parts.sequence_parallel, backend=parts.backend,
                                rng_tracker=parts.rng_tracker, cp_comm_type=parts.cp_comm_type, fp8=parts.fp8)


def projection_weights(config: ModelConfig) -> int:
    """Weights of one layer's projections: the query path, both key/value projections and the output projection."""
    nh, h = config.num_attention_heads, config.hidden_size
    q_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
    if config.q_lora_rank is None:
        queries = h * nh * q_dim
    else:
        queries = h * config.q_lora_rank + config.q_lora_rank * nh * q_dim
    keys_values = (h * (config.kv_lora_rank + config.qk_pos_emb_head_dim)
                   + config.kv_lora_rank * nh * (config.qk_head_dim + config.v_head_dim))
    return queries + keys_values + nh * config.v_head_dim * h


def flops(config: ModelConfig, spec: LayerSpec) -> float:
    """Its projections, and the scores and weighted sum over the whole sequence."""
    q_dims = config.qk_head_dim + config.qk_pos_emb_head_dim
    return 2 * projection_weights(config) + 2 * config.seq_length * config.num_attention_heads * (
        q_dims + config.v_head_dim)


def latent_attention_bytes(config: Config) -> int:
    """Bytes per token multi-latent attention saves beyond its input (module docstring)."""
    m, p = config.model, config.parallel
    e, nh = param_bytes(config), m.num_attention_heads // p.tensor_model_parallel_size
    q_dim = m.qk_head_dim + m.qk_pos_emb_head_dim
    ranks = [m.kv_lora_rank] + ([m.q_lora_rank] if m.q_lora_rank is not None else [])
    norm = (lambda r: 2 * FP32 * r + FP32) if m.normalization == "RMSNorm" else (lambda r: e * r + 2 * FP32)
    latents = sum((norm(r) if m.qk_layernorm else 0) + e * r for r in ranks)
    if m.qk_layernorm and e == FP32:  # the key/value latent's norm input is a view of the down-projection's output
        latents += FP32 * m.qk_pos_emb_head_dim
    padded = q_dim != m.v_head_dim and (p.context_parallel_size > 1 or m.attention_backend == "flash")
    values = max(q_dim, m.v_head_dim) if padded else m.qk_head_dim + m.v_head_dim
    return latents + e * nh * (2 * q_dim + values + m.v_head_dim)


def saved_bytes(config: Config, spec: LayerSpec) -> int:
    m, tokens = config.model, micro_batch_tokens(config)[0]
    heads = m.num_attention_heads // config.parallel.tensor_model_parallel_size
    lse = 0 if m.recompute_granularity == "selective" else FP32 * heads  # the kernel's log-sum-exp
    return tokens * (latent_attention_bytes(config) + lse)


KIND = Kind(build, flops, saved_bytes)
