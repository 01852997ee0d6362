"""Muon's update of one weight matrix: its momentum orthogonalised by a Newton-Schulz iteration, then scaled.

Muon (K. Jordan et al. 2024; Megatron-Core's --optimizer muon) replaces the momentum M = U S V^T of a 2-D weight
by an approximation of U V^T: the odd polynomial iteration X <- a X + b (X X^T) X + c (X X^T)^2 X, started from
X = M / ||M||_F (the Frobenius norm clamped at 1e-7) and run on the orientation whose Gram matrix X X^T is the
smaller (the iteration commutes with transposition, so this changes only the cost). --muon-coefficient-type
picks (a, b, c) per iteration, with emerging_optimizers' rules for --muon-num-ns-steps:

  simple         (3.4445, -4.7750, 2.0315) every iteration: Jordan's quintic
  quintic        five sets tuned one per iteration (modded-nanogpt); steps a multiple of 5, the sets cycled
  polar_express  the eight sets of Polar Express (Amsel et al. 2025); at least 8 steps, the last one repeated
  aol            four sets (flash-newton-schulz); steps a multiple of 4

The orthogonal update of an [out, in] matrix is multiplied by --muon-scale-mode's factor and by
--muon-extra-scale-factor:

  spectral       sqrt(max(out, in))      (Jordan; Moonlight, which adds the extra factor 0.2)
  unit_rms_norm  sqrt(out / in)          (Scion; Bernstein)
  shape_scaling  sqrt(max(1, out / in))  (Jordan's first release)

The iteration runs in fp32 (Megatron's GPU default, --muon-fp32-matmul-prec medium, runs it in bf16).

The fused QKV weight, [groups x (q + k + v) rows, in] in Megatron's per-group layout, is orthogonalised as three
matrices (every group's query rows, key rows, value rows) unless --muon-no-split-qkv. A matrix split across
tensor-parallel ranks is, by --muon-tp-mode: gathered and orthogonalised whole (duplicated; see muon_optimizer.py),
orthogonalised in place with the Gram matrices summed over the TP group (distributed: the same iteration, each
rank computing its rows or columns of it), or orthogonalised shard by shard (blockwise: a different optimizer,
whose update depends on the TP size). Rows or columns concatenated in another order than the global tensor's
(SwiGLU's [gate_r; up_r] shards) change nothing: the iteration commutes with permutations of rows and columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.config.muon_coefficients import coefficient_schedule
from megatron_lite.parallel import mappings

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
TP_MODES = ("duplicated", "distributed", "blockwise")
_EPS = 1e-7


def scale_factor(out_features: int, in_features: int, mode: str) -> float:
    if mode == "spectral":
        return max(out_features, in_features) ** 0.5
    if mode == "unit_rms_norm":
        return (out_features / in_features) ** 0.5
    return max(1.0, out_features / in_features) ** 0.5


@dataclass(frozen=True)
class MuonSettings:
    """What Muon's update of a matrix depends on, from OptimizerConfig (and the model, for the QKV split)."""

    coefficient_type: str = "quintic"
    steps: int = 5
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    qkv_split: tuple[int, int, int] | None = None  # rows of one query group's q, k, v; None: no split

    @classmethod
    def from_config(cls, optimizer, model) -> MuonSettings:
        split = None
        if not optimizer.muon_no_split_qkv:
            heads_per_group = model.num_attention_heads // model.num_query_groups
            split = (heads_per_group * model.head_dim, model.head_dim, model.head_dim)
        return cls(optimizer.muon_coefficient_type, optimizer.muon_num_ns_steps, optimizer.muon_scale_mode,
                   optimizer.muon_extra_scale_factor, split)


def newton_schulz(x: torch.Tensor, coefficients, gram_group=None, transpose: bool | None = None) -> torch.Tensor:
    """The orthogonalised fp32 [m, n] matrix `x`. With `gram_group`, `x` is this rank's rows (transpose=True)
    or columns (transpose=False) of the matrix, and the squared norm and Gram matrices are summed over the group."""
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    X = x.mT if transpose else x
    square = (X * X).sum()
    if gram_group is not None:
        mappings.all_reduce(square, gram_group)
    X = X / square.sqrt().clamp_min(_EPS)
    for a, b, c in coefficients:
        gram = X @ X.mT
        if gram_group is not None:
            mappings.all_reduce(gram, gram_group)
        X = a * X + (b * gram + c * gram @ gram) @ X
    return X.mT if transpose else X


def orthogonalized_update(matrix: torch.Tensor, settings: MuonSettings, *, is_qkv: bool, tp_dim: int | None = None,
                          tp_group=None, tp_size: int = 1) -> torch.Tensor:
    """Muon's update of the fp32 momentum (or Nesterov direction) `matrix`, [out, in]: orthogonalised, scaled.

    `tp_dim` and `tp_group` describe a matrix distributed over the TP group (--muon-tp-mode distributed):
    `matrix` is this rank's shard, the result its shard of the whole matrix's update."""
    coefficients = coefficient_schedule(settings.coefficient_type, settings.steps)
    parts = [matrix]
    if is_qkv and settings.qkv_split is not None:
        groups = matrix.size(0) // sum(settings.qkv_split)
        parts = [p.reshape(-1, matrix.size(1)) for p in matrix.view(groups, -1, matrix.size(1)).split(
            list(settings.qkv_split), dim=1)]
    updates = []
    for part in parts:
        shape = list(part.shape)
        if tp_group is not None:
            shape[tp_dim] *= tp_size
            update = newton_schulz(part, coefficients, tp_group, transpose=tp_dim == 0)
        else:
            update = newton_schulz(part, coefficients)
        updates.append(update * (scale_factor(*shape, settings.scale_mode) * settings.extra_scale_factor))
    if len(updates) == 1:
        return updates[0]
    groups = matrix.size(0) // sum(settings.qkv_split)
    return torch.cat([u.view(groups, -1, matrix.size(1)) for u in updates], dim=1).view_as(matrix)
