"""Multi-latent attention (MLA; DeepSeek-V2 section 2.1, DeepSeek-V3), chosen by --multi-latent-attention.

Per token x [h]:
    queries   q = W_q x, or with --q-lora-rank: q = W_q_up norm(W_q_down x)     [nh, qk_head_dim + qk_pos_emb_head_dim]
    keys/values: c, k_rope = W_kv_down x (a latent of --kv-lora-rank and one RoPE key shared by every head),
              [k_nope, v] = W_kv_up norm(c)                                   [nh, qk_head_dim], [nh, v_head_dim]
    each head: attention of [q_nope, rope(q_rope)] over [k_nope, rope(k_rope)], softmax scale from the whole
              query-key head dimension (times YaRN's mscale^2, model/attention/yarn.py), then the output projection.
The latent norms exist with --qk-layernorm, as in Megatron-Core (DeepSeek's checkpoints have them). RoPE is
applied to the interleaved pairs (x0, x1), (x2, x3).. of the rotated dimensions, as DeepSeek's weights are laid
out (transformers' rope_interleave): they are de-interleaved and rotated by halves, which gives every query-key
dot product the interleaved rotation gives. Names follow Megatron-Core (linear_q_proj or linear_q_down_proj /
linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj, q_layernorm, kv_layernorm, linear_proj).

Tensor parallelism splits the heads: the up-projections (and W_q without a query latent) are split by output
rows, whole heads per rank, and the output projection is row-parallel. The down-projections, the latent norms
and so the shared RoPE key are replicated: every rank computes them on the whole sequence (the input enters the
tensor-parallel region once, all-gathered along the sequence with sequence parallelism) and feeds them only to
its own heads, so each rank's gradient of them is a partial sum, which ShardSpec.sequence_parallel has
finalize_model_grads sum over TP, as for the norms. With --fp8-format only the output projection computes in FP8.

The query-key and value head dimensions differ (192 and 128 in DeepSeek-V3). SDPA takes that as it is; flash-attn
and the context-parallel block kernels take one head dimension, so there the smaller of V and Q/K is padded with
zeros to the larger (zero key dimensions add nothing to the scores, zero value dimensions are cut from the
output), at the cost of computing and sending the padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.self_attention import (
    CoreAttention,
    HeadNorm,
    Positions,
    apply_rotary,
    cached_causal_attention,
)
from megatron_lite.model.attention.yarn import YarnScaling
from megatron_lite.model.fp8 import FP8Recipe
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.model.tensor_parallel import RowParallelLinear
from megatron_lite.parallel import mappings
from megatron_lite.parallel.random import RNGTracker, checkpoint
from megatron_lite.parallel.state import ParallelState


class _Projection(torch.nn.Module):
    """y = x W^T on an input already in the tensor-parallel region: W split by output rows over TP (`split`),
    or replicated, its gradient then a partial sum over TP that finalize_model_grads completes."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, *, split: bool):
        super().__init__()
        spec = ShardSpec((out_features, in_features), tp_dim=0 if split else None,
                         sequence_parallel=not split and tp_size > 1)
        self.weight = new_parameter(spec, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[.., (x0, x1), (x2, x3), ..] -> [.., x0, x2, .., x1, x3, ..]: interleaved pairs to rotate-half layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MultiLatentAttention(torch.nn.Module):
    """MLA with SelfAttention's interface (model/attention/self_attention.py): [s(/tp), b, h] -> [s(/tp), b, h]."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool,
                 backend: str, rng_tracker: RNGTracker | None, cp_comm_type: str = "p2p",
                 fp8: FP8Recipe | None = None):
        super().__init__()
        tp = pstate.tp_size
        self.tp_group, self.sequence_parallel = pstate.group("tp"), sequence_parallel
        self.local_heads = config.num_attention_heads // tp
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        q_dim = self.nope_dim + self.rope_dim
        nh, h = config.num_attention_heads, config.hidden_size
        if config.q_lora_rank is None:
            self.linear_q_proj = _Projection(h, nh * q_dim, tp, split=True)
        else:
            self.linear_q_down_proj = _Projection(h, config.q_lora_rank, tp, split=False)
            self.q_layernorm = HeadNorm(config, tp, config.q_lora_rank) if config.qk_layernorm else None
            self.linear_q_up_proj = _Projection(config.q_lora_rank, nh * q_dim, tp, split=True)
        self.linear_kv_down_proj = _Projection(h, config.kv_lora_rank + self.rope_dim, tp, split=False)
        self.kv_layernorm = HeadNorm(config, tp, config.kv_lora_rank) if config.qk_layernorm else None
        self.linear_kv_up_proj = _Projection(config.kv_lora_rank, nh * (self.nope_dim + self.v_dim), tp, split=True)
        self.core_attention = CoreAttention(config.attention_dropout, backend, rng_tracker, pstate.group("cp"),
                                            (pstate.group("cp_a2a"), pstate.group("cp_p2p")), cp_comm_type)
        self.linear_proj = RowParallelLinear(nh * self.v_dim, h, pstate, bias=False,
                                             sequence_parallel=sequence_parallel, fp8=fp8)
        self.recompute_core_attention = config.recompute_granularity == "selective"
        self.pad_head_dims = q_dim != self.v_dim and (backend == "flash" or pstate.group("cp") is not None)
        # The kernels scale scores by 1/sqrt(their head dim); the queries carry the rest of MLA's scale.
        kernel_dim = max(q_dim, self.v_dim) if self.pad_head_dims else q_dim
        self.query_scale = YarnScaling.of(config).softmax_scale(q_dim) * math.sqrt(kernel_dim)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, nh/tp, qk_head_dim + qk_pos_emb_head_dim]."""
        if self.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            latent = self.linear_q_down_proj(x)  # [s, b, q_lora_rank], every rank the same
            q = self.linear_q_up_proj(self.q_layernorm(latent) if self.q_layernorm is not None else latent)
        return q.view(*q.shape[:2], self.local_heads, self.nope_dim + self.rope_dim)

    def forward(self, x: torch.Tensor, positions: Positions | None, kv_cache=None) -> torch.Tensor:
        """`positions` holds the RoPE angles of the qk_pos_emb_head_dim rotated dimensions; `kv_cache` (generation)
        keeps the expanded keys and values of earlier tokens, as SelfAttention's does."""
        positions = positions if positions is not None else Positions()
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h] -> [s, b, h]
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.tp_group)
        q_nope, q_rope = self._queries(x).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        kv = self.linear_kv_up_proj(latent)  # [s, b, nh/tp * (qk_head_dim + v_head_dim)]
        s, b = kv.shape[:2]
        k_nope, v = kv.view(s, b, self.local_heads, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        k_rope = k_rope.unsqueeze(2)  # [s, b, 1, rope_dim]: one key shared by every head
        if positions.cos is not None:
            q_rope = apply_rotary(_deinterleave(q_rope), positions.cos, positions.sin)
            k_rope = apply_rotary(_deinterleave(k_rope), positions.cos, positions.sin)
        q = torch.cat((q_nope, q_rope), dim=-1) * self.query_scale
        k = torch.cat((k_nope, k_rope.expand(s, b, self.local_heads, self.rope_dim)), dim=-1)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)
            return self.linear_proj(cached_causal_attention(q, k, v))
        if self.pad_head_dims:
            q, k, v = _pad_to_one_head_dim(q, k, v)
        if self.recompute_core_attention and self.training:
            out = checkpoint(self.core_attention, self.core_attention.rng_tracker, q, k, v, positions.documents)
        else:
            out = self.core_attention(q, k, v, positions.documents)
        if self.pad_head_dims and out.shape[-1] != self.local_heads * self.v_dim:  # drop the padded value dims
            out = out.view(s, b, self.local_heads, -1)[..., :self.v_dim].reshape(s, b, -1)
        return self.linear_proj(out)  # [s, b, nh/tp * v_head_dim] -> [s(/tp), b, h]


def _pad_to_one_head_dim(q, k, v):
    """Zeros appended to V's or to Q's and K's head dimension, whichever is smaller, so that all three match."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        return q, k, F.pad(v, (0, qk_dim - v_dim))
    return F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim)), v
