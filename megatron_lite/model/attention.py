"""Causal self-attention with grouped-query attention, rotary embeddings and swappable kernels.

The fused QKV weight is laid out per query group, as in Megatron: for each of the `ng` groups,
the group's `nh/ng` query heads, then its key head, then its value head. Tensor parallelism splits the
groups across ranks, so each rank's contiguous slice of the QKV output holds whole groups and
attention runs on local heads with no communication; the output projection is row-parallel.

The kernel is torch's scaled_dot_product_attention (SDPA) unless flash-attn is asked for. On CUDA in
bf16/fp16, SDPA may use only its fused kernels (cuDNN, flash, memory-efficient): its math fallback
materialises the [b, h, s, s] scores, so a case no fused kernel takes raises instead of silently running
slower and in far more memory. `sdpa_kernel_name` says which kernel actually runs for given shapes.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_lite.config import ModelConfig
from megatron_lite.model.context_parallel import context_parallel_attention
from megatron_lite.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.random import RNGTracker, checkpoint
from megatron_lite.parallel.state import ParallelState

try:  # optional CUDA kernel, used only with --attention-backend flash
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = None


class RotaryEmbedding(torch.nn.Module):
    """RoPE (Su et al. 2021) in the "rotate half" layout used by Llama and Hugging Face."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[s] positions -> cos, sin of shape [s, 1, 1, head_dim] (broadcast over batch and heads)."""
        freqs = torch.outer(position_ids.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [s, b, n, d] query or key vectors by their positions' angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def choose_attention_backend(requested: str, device: torch.device) -> str:
    """"sdpa" unless flash-attn is asked for (--attention-backend flash).

    "auto" is SDPA everywhere: flash-attn would be preferred only where it is measured faster than SDPA's
    own cuDNN and flash kernels, and no such measurement exists.
    """
    if requested == "flash":
        if flash_attn_func is None or device.type != "cuda":
            raise RuntimeError("--attention-backend flash needs the flash-attn package and a CUDA device")
        return "flash"
    return "sdpa"


FUSED_CUDA_KERNELS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def fused_sdpa_only(q: torch.Tensor):
    """A context in which SDPA may not fall back to math for this bf16/fp16 CUDA query: with no fused kernel
    for the case it raises "No available kernel" (torch's warnings say why each kernel declined).
    Elsewhere (CPU, fp32) SDPA chooses freely."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        return sdpa_kernel(FUSED_CUDA_KERNELS)
    return nullcontext()


class CoreAttention(torch.nn.Module):
    """softmax(Q K^T / sqrt(d)) V over this rank's heads, causal, with key/value heads shared per group.

    With a context-parallel group the local sequence is this rank's two load-balanced chunks and attention
    spans the whole group's sequence (model/context_parallel.py; `cp_comm_type` is --cp-comm-type).
    """

    def __init__(self, dropout: float, backend: str, rng_tracker: RNGTracker | None, cp_group=None):
        super().__init__()
        if cp_group is not None and dropout > 0:
            raise ValueError("attention dropout is not supported with context parallelism; set it to 0")
        self.dropout = dropout
        self.backend = backend
        self.rng_tracker = rng_tracker
        self.cp_group = cp_group
        self.cp_comm_type = "p2p"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [s, b, nh, d], k/v [s, b, ng, d] -> [s, b, nh * d]."""
        if self.cp_group is not None:
            return context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, self.backend)
        s, b = q.shape[:2]
        dropout = self.dropout if self.training else 0.0
        if self.backend == "flash":
            out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                  dropout_p=dropout, causal=True)  # [b, s, nh, d]
            return out.transpose(0, 1).reshape(s, b, -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        # heads are split over TP: dropout masks must differ per TP rank
        rng = self.rng_tracker.fork() if dropout > 0 and self.rng_tracker is not None else nullcontext()
        with rng, fused_sdpa_only(q):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [b, nh, s, d] -> [s, b, nh*d]


def sdpa_kernel_name(batch: int, seq_length: int, num_heads: int, num_query_groups: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device | str, dropout: float = 0.0) -> str:
    """The aten op that SDPA runs for CoreAttention's training forward at these shapes (one rank's heads):
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu", or the math
    fallback "_scaled_dot_product_attention_math".

    It runs one forward under torch.profiler and reads the op's name, so a benchmark reports the kernel
    that ran rather than the one it expected. Raises where CoreAttention would (no fused kernel on CUDA).
    """
    core = CoreAttention(dropout, "sdpa", rng_tracker=None)
    q = torch.randn(seq_length, batch, num_heads, head_dim, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(seq_length, batch, num_query_groups, head_dim, dtype=dtype, device=device,
                        requires_grad=True) for _ in range(2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        core(q, k, v)
    kernels = sorted({event.name.removeprefix("aten::") for event in profile.events()
                      if event.name.startswith("aten::_scaled_dot_product")})
    if len(kernels) != 1:
        raise RuntimeError(f"expected one SDPA kernel, the profiler recorded {kernels or 'none'}")
    return kernels[0]


def cached_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the s newest tokens over all t tokens so far (generation with a KV cache):
    q [s, b, nh, d], k/v [t, b, ng, d] -> [s, b, nh * d]; query i, at position t - s + i, sees keys 0..t - s + i."""
    s, b, t = q.shape[0], q.shape[1], k.shape[0]
    mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, n, s or t, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class SelfAttention(torch.nn.Module):
    """QKV projection (column-parallel) -> RoPE -> core attention -> output projection (row-parallel)."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool,
                 backend: str, rng_tracker: RNGTracker | None):
        super().__init__()
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_groups = config.num_query_groups // pstate.tp_size
        self.head_dim = config.head_dim
        bias = not config.disable_bias_linear
        qkv_size = (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size, pstate, bias=bias,
                                               sequence_parallel=sequence_parallel)
        self.core_attention = CoreAttention(config.attention_dropout, backend, rng_tracker, pstate.group("cp"))
        self.linear_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                             pstate, bias=bias, sequence_parallel=sequence_parallel)
        self.recompute_core_attention = False

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None,
                kv_cache=None) -> torch.Tensor:
        """`kv_cache` (generation only, see generation.py) holds this layer's keys and values of the tokens
        before x; x's are appended and x's tokens attend to all of them."""
        qkv = self.linear_qkv(x)  # [s, b, ng/tp * (nh/ng + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q, k, v = qkv.split([self.heads_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.local_groups * self.heads_per_group, self.head_dim)  # [s, b, nh/tp, d]
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, ng/tp, d]
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # [s_cached + s, b, ng/tp, d]
            out = cached_causal_attention(q, k, v)
        elif self.recompute_core_attention and self.training:
            out = checkpoint(self.core_attention, self.core_attention.rng_tracker, q, k, v)
        else:
            out = self.core_attention(q, k, v)
        return self.linear_proj(out)
