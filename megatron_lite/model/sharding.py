"""How each parameter relates to its global tensor, and layout-independent initialization.

Every parameter carries a `ShardSpec`: the global shape, which dimension (if any) is split across the
tensor-parallel ranks, and how it is initialized. A parameter's initial value is cut from a global
tensor drawn from a generator seeded by (seed, global name), so every parallel layout starts from the
weights a single device would create. Checkpoints use the same spec to map shards to global tensors.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch


@dataclass
class ShardSpec:
    """What a local parameter is a piece of.

    global_shape   shape of the whole tensor on a single device
    tp_dim         dimension split across TP ranks (None: replicated on every TP rank)
    tp_chunks      a fused tensor made of `tp_chunks` equal parts along tp_dim (SwiGLU's [gate; up]) is
                   split part by part, so each rank holds [gate_r; up_r]
    init           "normal" (std), "scaled_normal" (std / sqrt(2 * num_layers)), "ones" or "zeros"
    sequence_parallel  replicated across TP but each rank's gradient is a partial sum, so it is summed over TP:
                   norms and biases after a row-parallel layer fed a sequence slice under sequence
                   parallelism, and the q/k norms of --qk-layernorm, which see only the rank's heads
    expert         an expert weight: gradients are reduced over the expert-data-parallel group
    valid_rows     rows beyond this index are vocabulary padding, initialized to zero and never used
    tied_copy      the last pipeline stage's copy of tied word embeddings: kept equal to the first stage's
                   table, which alone counts it (in the gradient norm)
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


def name_seed(seed: int, global_name: str) -> int:
    """A stable 63-bit seed from the run seed and a parameter's global name (independent of layout)."""
    digest = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def global_initial_value(spec: ShardSpec, global_name: str, seed: int, std: float, num_layers: int):
    """The global tensor a single device would start from, drawn on the CPU for reproducibility."""
    if spec.init == "ones":
        return torch.ones(spec.global_shape)
    if spec.init == "zeros":
        return torch.zeros(spec.global_shape)
    scale = std if spec.init == "normal" else std / math.sqrt(2.0 * num_layers)
    generator = torch.Generator().manual_seed(name_seed(seed, global_name))
    full = torch.zeros(spec.global_shape)
    # Only the real vocabulary rows are drawn, so their values do not depend on the padding (which grows
    # with the TP size): torch's normal_ fills a tensor in blocks, and a longer tensor may change its tail.
    full[:spec.valid_rows].normal_(0.0, scale, generator=generator)
    return full


@torch.no_grad()
def initialize_parameters(named_parameters, seed: int, std: float, num_layers: int, tp_rank: int,
                          tp_size: int) -> None:
    """Set each (global_name, param) to its shard of the layout-independent initial value."""
    for global_name, param in named_parameters:
        full = global_initial_value(param.spec, global_name, seed, std, num_layers)
        param.copy_(shard(full, param.spec, tp_rank, tp_size))


@torch.no_grad()
def load_global_tensors(named_parameters, tensors: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> None:
    """Copy this rank's shard of each global tensor into the parameter of the same global name."""
    for global_name, param in named_parameters:
        if global_name not in tensors:
            raise KeyError(f"no tensor for parameter {global_name}")
        full = tensors[global_name]
        if tuple(full.shape) != tuple(param.spec.global_shape):
            raise ValueError(f"{global_name}: shape {tuple(full.shape)} does not match the model's "
                             f"{tuple(param.spec.global_shape)}")
        param.copy_(shard(full, param.spec, tp_rank, tp_size))
