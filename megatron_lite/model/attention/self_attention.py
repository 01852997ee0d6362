"""Causal self-attention with grouped-query attention, rotary embeddings and swappable kernels.

Model families: Llama 3.1's RoPE frequency scaling (--use-rope-scaling), a norm on each query and key head
(--qk-layernorm, Qwen3) and a bias on the QKV projection alone (--add-qkv-bias, Qwen2).

The fused QKV weight is laid out per query group, as in Megatron: for each of the `ng` groups,
the group's `nh/ng` query heads, then its key head, then its value head. Tensor parallelism splits the
groups across ranks, so each rank's contiguous slice of the QKV output holds whole groups and
attention runs on local heads with no communication; the output projection is row-parallel.

The kernel is torch's scaled_dot_product_attention (SDPA) unless flash-attn is asked for. On CUDA SDPA may
use only its fused kernels (cuDNN, flash, memory-efficient; in fp32 memory-efficient alone, with K/V repeated
to the query heads since it refuses enable_gqa): its math fallback materialises the [b, h, s, s] scores, so a
case no fused kernel takes raises instead of silently running slower and in far more memory (SdpaPlan).
`sdpa_kernel_name` says which kernel actually runs for given shapes.

Documents in a packed sequence (--reset-attention-mask): a token attends only to earlier tokens of its own
document. On CUDA that runs through FlexAttention, compiled, with a block mask built from the document ids
(as torchtitan does), so fully masked tiles are skipped and no [s, s] mask exists; elsewhere through SDPA
with a boolean [b, 1, s, s] mask (the CPU is a test path: it materialises the mask). Context parallelism
applies documents block by block (model/attention/context_parallel.py).
"""

from __future__ import annotations

import functools
import math
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.context_parallel import context_parallel_attention
from megatron_lite.model.attention.window_and_sinks import window_sink_attention
from megatron_lite.model.attention.window_context_parallel import context_parallel_window_sink_attention
from megatron_lite.model.attention.yarn import YarnScaling
from megatron_lite.model.fp8 import FP8Recipe
from megatron_lite.model.normalization import apply_norm
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.random import RNGTracker, checkpoint
from megatron_lite.parallel.state import ParallelState

try:  # optional CUDA kernel, used only with --attention-backend flash
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = None


class Documents:
    """The documents packed into a micro-batch's sequences (--reset-attention-mask), and the masks made from them.

    `ids` [b, s] holds each token's document index, nondecreasing along the sequence; an end-of-document token
    belongs to the document it ends. With context parallelism it still covers the whole sequence, since a
    rank's ring blocks need the documents of other ranks' keys. The ids stay on the host, where context
    parallelism plans its blocks; each mask is made on `device` once per micro-batch and shared by the layers.
    """

    def __init__(self, ids: torch.Tensor, device: torch.device):
        self.ids = ids.cpu()
        self.device = device

    @functools.cached_property
    def device_ids(self) -> torch.Tensor:
        """`ids` on `device`, copied once per micro-batch without waiting (the loader pins batches on CUDA)."""
        return self.ids.to(self.device, non_blocking=True)

    @functools.cached_property
    def attention_mask(self) -> torch.Tensor:
        """[b, 1, s, s] bool, True where query t may attend to key u: the same document and u <= t."""
        ids = self.device_ids
        return (ids.unsqueeze(2) == ids.unsqueeze(1)).tril().unsqueeze(1)

    @functools.cached_property
    def block_mask(self) -> BlockMask:
        """The same mask as FlexAttention's BlockMask: which 128 x 128 tiles are empty, full or partial. On CUDA
        create_block_mask runs compiled, as in torchtitan: run eagerly it builds the [b, 1, s, s] booleans before
        reducing them to tiles."""
        ids = self.device_ids

        def same_document_causal(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

        make = _compiled(create_block_mask) if self.device.type == "cuda" else create_block_mask
        return make(same_document_causal, ids.shape[0], None, ids.shape[1], ids.shape[1], device=self.device)


class Positions(NamedTuple):
    """Where a micro-batch's tokens are, as attention needs it: the RoPE angles cos, sin [s, 1 or b, 1, d] (None
    with learned absolute positions) and the packed documents (None: each sample is one causal stream). The
    transformer layers hand it to attention unchanged."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    documents: Documents | None = None


@functools.cache
def _compiled(function):
    """torch.compile(function), compiled once per process. FlexAttention is a fused kernel only when compiled;
    run eagerly it computes the whole score matrix."""
    return torch.compile(function)


class RopeScaling(NamedTuple):
    """Llama 3.1's RoPE scaling (--use-rope-scaling and the --rope-scaling-* flags; HF's rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @classmethod
    def of(cls, config: ModelConfig) -> RopeScaling | None:
        """The model's scaling, or None without --use-rope-scaling."""
        if not config.use_rope_scaling:
            return None
        return cls(config.rope_scaling_factor, config.rope_scaling_low_freq_factor,
                   config.rope_scaling_high_freq_factor, config.rope_scaling_original_max_position_embeddings)

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Slow the low frequencies down by `factor` so that positions past the original context length look like
        positions within it, keep the high frequencies (local order), and interpolate linearly in wavelength
        between the two: the formula of Meta's Llama 3.1 and transformers' `_compute_llama3_parameters`."""
        context = self.original_max_position_embeddings
        wavelength = 2 * math.pi / inv_freq
        smooth = (context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelength > context / self.low_freq_factor, inv_freq / self.factor, inv_freq)
        medium = (wavelength >= context / self.high_freq_factor) & (wavelength <= context / self.low_freq_factor)
        return torch.where(medium, interpolated, scaled)


class RotaryEmbedding(torch.nn.Module):
    """RoPE (Su et al. 2021) in the "rotate half" layout used by Llama and Hugging Face, with the frequency
    scaling `scaling` when given: Llama 3.1's (RopeScaling) or YaRN's (model/attention/yarn.py), whose attention
    factor multiplies cos and sin."""

    def __init__(self, head_dim: int, base: float, scaling: RopeScaling | YarnScaling | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling is not None:
            inv_freq = scaling.apply(inv_freq)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = scaling.attention_factor if isinstance(scaling, YarnScaling) else 1.0

    def forward(self, position_ids: torch.Tensor) -> Positions:
        """[s] positions shared by the batch, or [b, s] per sample (--reset-position-ids) -> cos, sin of shape
        [s, 1, 1, head_dim] or [s, b, 1, head_dim] (broadcast over heads, and over the batch when shared)."""
        freqs = position_ids.float().unsqueeze(-1) * self.inv_freq  # [s, d/2] or [b, s, d/2]
        freqs = freqs.unsqueeze(1) if position_ids.dim() == 1 else freqs.transpose(0, 1)  # [s, 1 or b, d/2]
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(2)  # [s, 1 or b, 1, d]
        if self.attention_factor != 1.0:
            return Positions(emb.cos() * self.attention_factor, emb.sin() * self.attention_factor)
        return Positions(emb.cos(), emb.sin())


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
    """The model's RoPE: over the first --rotary-percent of each head's dimensions (all by default; Qwen3-Next a
    quarter) with Llama 3.1's scaling if asked, or YaRN's with --position-embedding-type yarn; with multi-latent
    attention over its qk-pos-emb-head-dim rotated dimensions with YaRN's scaling (plain RoPE at
    --rotary-scaling-factor 1)."""
    if config.multi_latent_attention:
        return RotaryEmbedding(config.qk_pos_emb_head_dim, config.rotary_base, YarnScaling.of(config))
    if config.position_embedding_type == "yarn":
        return RotaryEmbedding(config.rotary_dims, config.rotary_base, YarnScaling.of(config))
    return RotaryEmbedding(config.rotary_dims, config.rotary_base, RopeScaling.of(config))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [s, b, n, d] query or key vectors by their positions' angles; with angles for fewer than d
    dimensions (--rotary-percent), those leading dimensions, the rest passing unrotated."""
    if cos.shape[-1] < x.shape[-1]:
        rotated_dims = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :rotated_dims], cos, sin), x[..., rotated_dims:]], dim=-1)
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


class SdpaPlan(NamedTuple):
    """How SDPA is called on a device and dtype: the kernels it may choose from (None: any) and whether the
    key/value heads are first repeated to the query heads rather than shared through enable_gqa."""

    kernels: list[SDPBackend] | None
    repeat_kv: bool

    @classmethod
    def of(cls, device_type: str, dtype: torch.dtype) -> SdpaPlan:
        """On CUDA only fused kernels, so that a case none takes raises "No available kernel" (torch's warnings
        say why each declined) instead of running math, which materialises the [b, h, s, s] scores. In bf16 and
        fp16 cuDNN, flash and memory-efficient take grouped queries; in fp32 only memory-efficient runs, and it
        refuses enable_gqa, so K/V are repeated for it. Elsewhere (CPU) SDPA chooses freely."""
        if device_type != "cuda":
            return cls(None, False)
        if dtype in (torch.bfloat16, torch.float16):
            return cls(FUSED_CUDA_KERNELS, False)
        return cls([SDPBackend.EFFICIENT_ATTENTION], True)

    def kernel_context(self):
        """The scope in which SDPA may choose only `kernels` (none: any)."""
        return nullcontext() if self.kernels is None else sdpa_kernel(self.kernels)

    def key_values(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [b, ng, s, d] as SDPA takes them here: repeated to [b, nh, s, d] where `repeat_kv` (query head i
        uses key/value head i // (nh / ng), as enable_gqa does), else as they are."""
        if not self.repeat_kv or k.shape[1] == q.shape[1]:
            return k, v
        per_group = q.shape[1] // k.shape[1]
        return k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)


def flex_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents) -> torch.Tensor:
    """q [b, nh, s, d], k/v [b, ng, s, d] -> [b, nh, s, d] through FlexAttention with the documents' block mask:
    compiled on CUDA; elsewhere eager, forward only (FlexAttention has no CPU backward), which tests use."""
    attend = _compiled(flex_attention) if q.device.type == "cuda" else flex_attention
    return attend(q, k, v, block_mask=documents.block_mask, enable_gqa=True)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents,
                       dropout: float) -> torch.Tensor:
    """q [b, nh, s, d], k/v [b, ng, s, d] -> [b, nh, s, d], each token attending to the tokens of its own document
    up to itself: FlexAttention on CUDA (no dropout there), SDPA with the boolean mask elsewhere."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.attention_mask, dropout_p=dropout,
                                              enable_gqa=True)
    if dropout > 0:
        raise ValueError("FlexAttention has no attention dropout: pass --attention-dropout 0 with "
                         "--reset-attention-mask")
    return flex_document_attention(q, k, v, documents)


class CoreAttention(torch.nn.Module):
    """softmax(Q K^T / sqrt(d)) V over this rank's heads, causal, with key/value heads shared per group; with
    `documents`, causal within each document only.

    With a context-parallel group the local sequence is this rank's two load-balanced chunks and attention
    spans the whole group's sequence (model/attention/context_parallel.py; `cp_comm_type` is --cp-comm-type).
    """

    def __init__(self, dropout: float, backend: str, rng_tracker: RNGTracker | None, cp_group=None,
                 hierarchical_cp_groups: tuple | None = None, cp_comm_type: str = "p2p"):
        super().__init__()
        if cp_group is not None and dropout > 0:
            raise ValueError("attention dropout is not supported with context parallelism; set it to 0")
        self.dropout = dropout
        self.backend = backend
        self.rng_tracker = rng_tracker
        self.cp_group = cp_group
        self.hierarchical_cp_groups = hierarchical_cp_groups  # (a2a, p2p) subgroups of cp, for a2a+p2p
        self.cp_comm_type = cp_comm_type

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """q [s, b, nh, d], k/v [s, b, ng, d] -> [s, b, nh * d]."""
        if self.cp_group is not None:
            return context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, self.backend,
                                              documents.ids if documents is not None else None,
                                              self.hierarchical_cp_groups)
        s, b = q.shape[:2]
        dropout = self.dropout if self.training else 0.0
        if self.backend == "flash" and documents is None:  # documents: validation refuses flash-attn (no varlen)
            out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                  dropout_p=dropout, causal=True)  # [b, s, nh, d]
            return out.transpose(0, 1).reshape(s, b, -1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        # heads are split over TP: dropout masks must differ per TP rank
        rng = self.rng_tracker.fork() if dropout > 0 and self.rng_tracker is not None else nullcontext()
        plan = SdpaPlan.of(q.device.type, q.dtype)
        with rng, plan.kernel_context():
            if documents is None:
                k, v = plan.key_values(q, k, v)
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=True)
            else:
                out = document_attention(q, k, v, documents, dropout)
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


class HeadNorm(torch.nn.Module):
    """--qk-layernorm: the --normalization norm (RMSNorm or LayerNorm, zero-centred with --apply-layernorm-1p) of
    each query or key head over its head_dim, one weight shared by all heads, as Megatron's q_layernorm/k_layernorm
    and Qwen3's q_norm/k_norm.

    Every TP rank holds the whole weight but normalizes only its own heads, so each rank's gradient is a partial
    sum: the spec marks it for the all-reduce over TP that finalize_model_grads gives such parameters. `size`
    other than head_dim: multi-latent attention's latent norms (model/attention/mla.py), replicated over TP as well.
    """

    def __init__(self, config: ModelConfig, tp_size: int, size: int | None = None):
        super().__init__()
        self.kind = config.normalization
        self.eps = config.norm_epsilon
        self.zero_centered = config.apply_layernorm_1p
        spec = dict(global_shape=(size or config.head_dim,), sequence_parallel=tp_size > 1)
        self.weight = new_parameter(ShardSpec(**spec, init="zeros" if self.zero_centered else "ones"), 1)
        self.bias = new_parameter(ShardSpec(**spec, init="zeros"), 1) if self.kind == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, n, d] -> the same, each head normalized over d."""
        return apply_norm(x, self.kind, self.weight, self.bias, self.eps, self.zero_centered)


class SelfAttention(torch.nn.Module):
    """QKV projection (column-parallel) -> per-head q/k norms (--qk-layernorm) -> RoPE -> core attention ->
    output projection (row-parallel). `fp8`: both projections' GEMMs in FP8; the core attention is not.

    With --attention-output-gate (Qwen3-Next) the projection also makes a gate for every query head, next to it
    (per group: [q_0, gate_0, q_1, gate_1, .., k, v], Megatron's layout), and each head's output is multiplied
    by sigmoid(gate) before the output projection. With a `window` (this layer's --window-size) or attention sinks
    (--softmax-type learnable or off-by-one) the core attention is window_and_sinks.py's; the learned sinks are
    split over TP with their heads."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool,
                 backend: str, rng_tracker: RNGTracker | None, cp_comm_type: str = "p2p",
                 fp8: FP8Recipe | None = None, window: int | None = None):
        super().__init__()
        self.window, self.softmax_type = window, config.softmax_type
        self.sinks = (new_parameter(ShardSpec((config.num_attention_heads,), tp_dim=0, init="zeros"), pstate.tp_size)
                      if config.softmax_type == "learnable" else None)
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_groups = config.num_query_groups // pstate.tp_size
        self.head_dim = config.head_dim
        self.output_gate = config.attention_output_gate
        self.query_slots = self.heads_per_group * (2 if self.output_gate else 1)  # head-sized rows per group
        bias = not config.disable_bias_linear
        qkv_size = (config.num_attention_heads * (2 if self.output_gate else 1)
                    + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, qkv_size, pstate, bias=bias or config.add_qkv_bias,
                                               sequence_parallel=sequence_parallel, fp8=fp8)
        if config.qk_layernorm:
            self.q_layernorm, self.k_layernorm = HeadNorm(config, pstate.tp_size), HeadNorm(config, pstate.tp_size)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.core_attention = CoreAttention(config.attention_dropout, backend, rng_tracker, pstate.group("cp"),
                                            (pstate.group("cp_a2a"), pstate.group("cp_p2p")), cp_comm_type)
        self.linear_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                             pstate, bias=bias, sequence_parallel=sequence_parallel, fp8=fp8)
        self.recompute_core_attention = config.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, positions: Positions | None, kv_cache=None) -> torch.Tensor:
        """`positions` None: no RoPE and plain causal attention. `kv_cache` (generation only: inference/generation.py)
        holds this layer's keys and values of the tokens before x; x's are appended and x's tokens attend to all
        of them."""
        positions = positions if positions is not None else Positions()
        qkv = self.linear_qkv(x)  # [s, b, ng/tp * (nh/ng + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.query_slots + 2, self.head_dim)
        q, k, v = qkv.split([self.query_slots, 1, 1], dim=3)
        gate = None
        if self.output_gate:
            q, gate = q.unflatten(3, (self.heads_per_group, 2)).unbind(4)
            gate = gate.reshape(s, b, -1)  # [s, b, nh/tp * d]
        q = q.reshape(s, b, self.local_groups * self.heads_per_group, self.head_dim)  # [s, b, nh/tp, d]
        k, v = k.squeeze(3), v.squeeze(3)  # [s, b, ng/tp, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if positions.cos is not None:
            q, k = apply_rotary(q, positions.cos, positions.sin), apply_rotary(k, positions.cos, positions.sin)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # [s_cached + s, b, ng/tp, d]
        materialised = self.window is not None or self.softmax_type != "vanilla"
        if kv_cache is not None and not materialised:
            out = cached_causal_attention(q, k, v)
        else:
            core = self._window_sink_attention if materialised else self.core_attention
            if self.recompute_core_attention and self.training:
                out = checkpoint(core, self.core_attention.rng_tracker, q, k, v, positions.documents)
            else:
                out = core(q, k, v, positions.documents)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.linear_proj(out)

    def _window_sink_attention(self, q, k, v, documents):
        """The core attention of a layer with a window or sinks (window_and_sinks.py; over the CP group under
        context parallelism), which materialises its scores: --recompute-granularity selective recomputes it as
        it does the fused kernel."""
        sinks = self.sinks if self.softmax_type == "learnable" else (
            q.new_zeros(q.shape[2]) if self.softmax_type == "off-by-one" else None)
        document_ids = documents.ids if documents is not None else None
        cp_group = self.core_attention.cp_group
        if cp_group is not None:
            return context_parallel_window_sink_attention(q, k, v, cp_group, self.core_attention.cp_comm_type,
                                                          window=self.window, sinks=sinks, document_ids=document_ids)
        return window_sink_attention(q, k, v, window=self.window, sinks=sinks, document_ids=document_ids)
