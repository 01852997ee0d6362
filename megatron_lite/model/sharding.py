"""How each parameter relates to its global tensor, and layout-independent initialization.

Every parameter carries a `ShardSpec`: the global shape, which dimension (if any) is split across the
tensor-parallel ranks, and how it is initialized. A parameter's initial value is element by element a
pure function of (seed, global name, global index): a counter-based generator evaluated on the rank's
own indices, so every parallel layout starts from the weights a single device would create while a rank
computes only the elements it holds. Checkpoints use the same spec to map shards to global tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
from dataclasses import dataclass

import torch

from megatron_lite.parallel.state import TensorSplit


@dataclass
class ShardSpec:
    """What a local parameter is a piece of.

    global_shape   shape of the whole tensor on a single device
    tp_dim         dimension split across TP ranks (None: replicated on every TP rank)
    tp_chunks      a fused tensor made of `tp_chunks` equal parts along tp_dim (SwiGLU's [gate; up]) is
                   split part by part, so each rank holds [gate_r; up_r]
    init           "normal" (std), "scaled_normal" (std / sqrt(2 * num_layers)), "ones", "zeros", or Mamba-2's
                   per-head vectors: "log_arange" (element i is log(i + 1): A_log for A = 1 .. heads) and
                   "mamba_dt" (the inverse softplus of steps log-spaced from 0.001 to 0.1 over the heads: dt_bias,
                   Megatron's range, spread evenly rather than drawn)
    sequence_parallel  replicated across TP but each rank's gradient is a partial sum, so it is summed over TP:
                   norms and biases after a row-parallel layer fed a sequence slice under sequence
                   parallelism, and the q/k norms of --qk-layernorm, which see only the rank's heads
    expert         an expert weight: gradients are reduced over the expert-data-parallel group
    valid_rows     rows beyond this index are vocabulary padding, initialized to zero and never used
    tied_copy      the last pipeline stage's copy of tied word embeddings (or of the embedding tables that
                   multi-token prediction reads): kept equal to the first stage's table, which alone counts it
                   (in the gradient norm)
    """

    global_shape: tuple[int, ...]
    tp_dim: int | None = None
    tp_chunks: int = 1
    init: str = "normal"
    sequence_parallel: bool = False
    expert: bool = False
    valid_rows: int | None = None
    tied_copy: bool = False


@dataclass
class FlatShard:
    """Elements [start, stop) of this rank's tensor-parallel shard of a parameter, flattened row-major.

    `data` is a live 1-D tensor of stop - start elements: reading it saves, writing into it loads. `spec`
    places the TP shard in the global tensor (with this rank's TP rank). Optimizer states and ZeRO-3
    parameters are handed to checkpoints as FlatShards."""

    data: torch.Tensor
    spec: ShardSpec
    flat_range: tuple[int, int]



def new_parameter(spec: ShardSpec, tp_size: int, dtype=torch.float32, device=None) -> torch.nn.Parameter:
    """An uninitialized local parameter shaped as this rank's shard of `spec.global_shape`."""
    shape = list(spec.global_shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] //= tp_size
    param = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    param.spec = spec
    return param


def shard(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's piece of the global tensor `full`."""
    if spec.tp_dim is None or tp_size == 1:
        return full
    parts = full.chunk(spec.tp_chunks, dim=spec.tp_dim)
    return torch.cat([p.chunk(tp_size, dim=spec.tp_dim)[tp_rank] for p in parts], dim=spec.tp_dim)


def unshard(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of `shard`: the global tensor from every TP rank's piece, in TP-rank order."""
    if spec.tp_dim is None or len(pieces) == 1:
        return pieces[0]
    per_rank = [p.chunk(spec.tp_chunks, dim=spec.tp_dim) for p in pieces]
    parts = [torch.cat([r[i] for r in per_rank], dim=spec.tp_dim) for i in range(spec.tp_chunks)]
    return torch.cat(parts, dim=spec.tp_dim)


def _name_key(seed: int, global_name: str) -> tuple[int, int, int, int]:
    """Four 32-bit words from the run seed and a parameter's global name (independent of layout)."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return tuple(int.from_bytes(digest[4 * i:4 * i + 4], "little") for i in range(4))


_MASK32 = 0xFFFFFFFF
_BLOCK_ELEMENTS = 1 << 17  # elements drawn at once: their int64 and float64 temporaries stay in cache


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """In place, a 32-bit integer hash (Wellons' lowbias32) of an int64 tensor holding values below 2**32.
    Products may wrap past 2**63; their low 32 bits, all that is kept, are exact."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= _MASK32
    x ^= x >> 15
    x *= 0x846CA68B
    x &= _MASK32
    x ^= x >> 16
    return x


def _mix32_int(x: int) -> int:
    return int(_mix32_(torch.tensor([x], dtype=torch.int64))[0])


def _standard_normal_at(index: torch.Tensor, key: tuple[int, int, int, int]) -> torch.Tensor:
    """N(0, 1) values, each a pure function of (key, its global flat index): the counter's high word is hashed
    into its low one, two 32-bit uniforms are hashed from that, and Box-Muller runs in float64 (rounded to
    float32 once, so that the vectorized and scalar paths of the transcendental functions agree to the
    float32 value)."""
    high = index >> 32
    if bool((high == high.flatten()[0]).all()):  # one high word in the block (any tensor under 2**32 elements)
        mixed = (index & _MASK32) ^ (_mix32_int(int(high.flatten()[0]) ^ key[1]) ^ key[0])
    else:
        mixed = (index & _MASK32) ^ _mix32_(high ^ key[1]) ^ key[0]
    _mix32_(mixed)
    u1 = _mix32_(mixed ^ key[2]).double().add_(0.5).mul_(2.0**-32)  # in (0, 1): the logarithm is finite
    u2 = _mix32_(mixed ^ key[3]).double().add_(0.5).mul_(2.0 * math.pi * 2.0**-32)
    return u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_()).float()


def shard_indices(spec: ShardSpec, tp_rank: int, tp_size: int, device=None) -> list[torch.Tensor]:
    """Per dimension, the global indices this TP rank's shard covers (the split one part by part, as `shard`)."""
    indices = [torch.arange(n, device=device) for n in spec.global_shape]
    if spec.tp_dim is not None and tp_size > 1:
        part = spec.global_shape[spec.tp_dim] // spec.tp_chunks
        width = part // tp_size
        indices[spec.tp_dim] = torch.cat([torch.arange(j * part + tp_rank * width, j * part + (tp_rank + 1) * width,
                                                       device=device) for j in range(spec.tp_chunks)])
    return indices


def draw_normal_shard(out: torch.Tensor, spec: ShardSpec, global_name: str, seed: int, scale: float,
                      tp_rank: int, tp_size: int) -> None:
    """Fill `out`, this TP rank's shard, with N(0, scale^2) values that depend only on (seed, global name,
    global index): every layout computes the same value for the same element and no rank computes another
    rank's elements. Rows from `spec.valid_rows` on (vocabulary padding) are zero."""
    records = _DRAWS.get()
    if records is not None:
        records.append((global_name, out.numel()))
    key = _name_key(seed, global_name)
    indices = shard_indices(spec, tp_rank, tp_size, out.device)
    strides = [math.prod(spec.global_shape[d + 1:]) for d in range(len(spec.global_shape))]
    trailing = torch.zeros((), dtype=torch.int64, device=out.device)
    for d in range(len(indices) - 1, 0, -1):  # [local row elements]: flat offsets of a row's elements
        trailing = (indices[d] * strides[d]).view(-1, *([1] * trailing.dim())) + trailing
    trailing = trailing.reshape(-1)
    rows = indices[0]
    rows_per_block = max(1, _BLOCK_ELEMENTS // trailing.numel())
    for start in range(0, rows.numel(), rows_per_block):
        block_rows = rows[start:start + rows_per_block]
        values = _standard_normal_at(block_rows[:, None] * strides[0] + trailing[None, :], key) * scale
        if spec.valid_rows is not None:
            values[block_rows >= spec.valid_rows] = 0.0
        target = out[start:start + rows_per_block]
        target.copy_(values.reshape(target.shape))


def global_initial_value(spec: ShardSpec, global_name: str, seed: int, std: float, num_layers: int):
    """The global tensor a single device would start from (every layout's shards are cut from it)."""
    full = torch.empty(spec.global_shape)
    _initialize(full, spec, global_name, seed, std, num_layers, 0, 1)
    return full


def _initialize(out: torch.Tensor, spec: ShardSpec, global_name: str, seed: int, std: float, num_layers: int,
                tp_rank: int, tp_size: int) -> None:
    if spec.init in ("ones", "zeros"):
        out.fill_(1.0 if spec.init == "ones" else 0.0)
        return
    if spec.init in ("log_arange", "mamba_dt"):
        start = tp_rank * out.shape[0] if spec.tp_dim == 0 else 0
        index = torch.arange(start, start + out.shape[0], dtype=torch.float64)
        if spec.init == "log_arange":
            out.copy_((index + 1).log())
        else:
            dt = torch.exp(math.log(1e-3) + (math.log(0.1) - math.log(1e-3)) * index / max(spec.global_shape[0] - 1, 1))
            out.copy_(dt + torch.log(-torch.expm1(-dt)))
        return
    scale = std if spec.init == "normal" else std / math.sqrt(2.0 * num_layers)
    draw_normal_shard(out, spec, global_name, seed, scale, tp_rank, tp_size)


_SKIP_INITIALIZATION = contextvars.ContextVar("skip_initialization", default=False)
_DRAWS: contextvars.ContextVar[list | None] = contextvars.ContextVar("draws", default=None)


@contextlib.contextmanager
def recorded_draws():
    """Within this scope, (global name, elements) of every `draw_normal_shard` call, in a list: what a rank's
    initialization computes, which tests and benchmarks/startup.py compare with what the rank holds."""
    records: list[tuple[str, int]] = []
    token = _DRAWS.set(records)
    try:
        yield records
    finally:
        _DRAWS.reset(token)


@contextlib.contextmanager
def initialization_skipped(skip: bool = True):
    """Within this scope, `initialize_parameters` only zeroes parameters: for a model whose every parameter a
    checkpoint is about to overwrite (a resume), the draw would be work thrown away. Zero, not left as
    allocated: what a checkpoint does not hold (the vocabulary padding rows, whose number depends on the
    layout) must be zero, as a fresh draw leaves it."""
    token = _SKIP_INITIALIZATION.set(skip)
    try:
        yield
    finally:
        _SKIP_INITIALIZATION.reset(token)


@torch.no_grad()
def initialize_parameters(named_parameters, seed: int, std: float, num_layers: int, split: TensorSplit) -> None:
    """Set each (global_name, param) to its shard of the layout-independent initial value, computing only
    the shard's own elements (zeroed instead inside `initialization_skipped`)."""
    skip = _SKIP_INITIALIZATION.get()
    for global_name, param in named_parameters:
        if skip:
            param.zero_()
        else:
            _initialize(param, param.spec, global_name, seed, std, num_layers, *split.of(param.spec))


@torch.no_grad()
def load_global_tensors(named_parameters, tensors: dict[str, torch.Tensor], split: TensorSplit) -> None:
    """Copy this rank's shard of each global tensor into the parameter of the same global name."""
    for global_name, param in named_parameters:
        if global_name not in tensors:
            raise KeyError(f"no tensor for parameter {global_name}")
        full = tensors[global_name]
        if tuple(full.shape) != tuple(param.spec.global_shape):
            raise ValueError(f"{global_name}: shape {tuple(full.shape)} does not match the model's "
                             f"{tuple(param.spec.global_shape)}")
        param.copy_(shard(full, param.spec, *split.of(param.spec)))
