"""--optimizer muon: Muon for the hidden weight matrices, AdamW (the scalar optimizer) for the rest.

Muon steps every 2-D weight but the embeddings, the output layer, the MoE router and the shared expert's gate
(`uses_muon`); AdamW steps those and every norm and bias, with Adam's state and checkpoint keys. Gradient norm,
clipping, the NaN check, fp16 loss scaling and fp32 masters of bf16/fp16 weights are the plain optimizer's
(optim/optimizer.py). A Muon step of a matrix W with clipped gradient G, momentum buffer B (fp32, zero at
first), momentum mu, learning rate lr and weight decay wd, as in Megatron-Core (emerging_optimizers):

    W <- W (1 - lr wd)
    B <- mu B + (1 - mu) G
    D <- (1 - mu) G + mu B  with --muon-nesterov, else B
    W <- W - lr orthogonalized_update(D)  (optim/muon.py: Newton-Schulz, then scaled)

The momentum and the Nesterov direction are element-wise, so each rank computes them on the elements it
steps; the orthogonalisation needs the whole matrix. Without the distributed optimizer a rank holds its TP
shard of every matrix whole, and data-parallel replicas all orthogonalise alike. With it (ZeRO-1/2/3) a
matrix's elements are spread over the data-parallel ranks of its bucket: each matrix has an owner among
them, the ranks are balanced by Newton-Schulz FLOPs (largest first, to the least loaded), every rank's
elements of the direction are gathered at the owner, which orthogonalises the matrix, and each rank gets
back its elements of the update (a scatter) and steps its masters; the parameter all-gather of the ZeRO
stage then carries the new weights. A rank holds the matrices it owns, whole, for the step (never a matrix it
does not own). TP ranks with the same data-parallel position own the same matrices. Under
--muon-tp-mode duplicated an owner gathers the TP shards along the split dimension, orthogonalises the
whole matrix and keeps its shard's rows or columns; distributed iterates on the shards with the Gram
matrices summed over TP; blockwise orthogonalises each shard as a matrix of its own.

Checkpoints add `optimizer.state.momentum_buffer.<global name>` (a FlatShard of the rank's elements, as
Adam's moments) and the fp32 masters of low-precision matrices under `optimizer.state.fp32_param.`, so a
run reshards like an Adam run. `optimizer.step` counts the applied steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.config.sections import Config
from megatron_lite.model.sharding import FlatShard
from megatron_lite.optim.distributed_optimizer import DistributedOptimizer
from megatron_lite.optim.muon import MuonSettings, orthogonalized_update
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.optim.param_and_grad_buffer import OwnedRange, storage_bytes
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState

_SCALAR_PREFIXES = ("embedding.", "output_layer.")
_SCALAR_SUFFIXES = ("router.weight", "gate_weight")


def uses_muon(name: str, param: torch.nn.Parameter) -> bool:
    """Whether Muon steps this parameter: a 2-D hidden weight (not an embedding, the output layer, the router
    or the shared expert's gate)."""
    return param.ndim == 2 and not name.startswith(_SCALAR_PREFIXES) and not name.endswith(_SCALAR_SUFFIXES)


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs of the iteration on an [rows, cols] matrix (Gram of the smaller side m, larger n):
    X X^T 2 m^2 n, its square 2 m^3, the product with X 2 m^2 n per step."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass
class _Matrix:
    """One matrix Muon steps, as this rank sees it. `pieces[q]` is the flat element range that rank q of
    `group` steps (group None: this rank steps it whole); `owned` this rank's range or None."""

    name: str
    param: torch.nn.Parameter
    group: object
    rank: int
    pieces: list[tuple[int, int]]
    owner: int = 0
    owned: OwnedRange | None = None
    master: torch.Tensor | None = None
    momentum: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return max(stop - start for start, stop in self.pieces)


class _MuonSteps:
    """The Muon half of the optimizers below (combined with Optimizer or DistributedOptimizer)."""

    def _steps_with_adam(self, owned: OwnedRange) -> bool:
        return not uses_muon(self.names[owned.param], owned.param)

    def _setup_muon(self, config: Config) -> None:
        o = config.optimizer
        self.settings = MuonSettings.from_config(o, config.model)
        self.momentum, self.nesterov, self.tp_mode = o.muon_momentum, o.muon_nesterov, o.muon_tp_mode
        self.weight_decay = o.weight_decay
        self.muon_steps = 0
        self.matrices = self._matrices()
        self._assign_owners()
        masters = {id(owned.param): (owned, master) for owned, master in self._masters()}
        owned = [m for m in self.matrices if id(m.param) in masters]
        numel = sum(masters[id(m.param)][0].stop - masters[id(m.param)][0].start for m in owned)
        device = owned[0].param.device if owned else "cpu"
        buffer = torch.zeros(numel, dtype=torch.float32, device=device)  # every momentum buffer, one allocation
        start = 0
        for matrix in owned:
            matrix.owned, matrix.master = masters[id(matrix.param)]
            size = matrix.owned.stop - matrix.owned.start
            matrix.momentum, start = buffer[start:start + size], start + size

    def _assign_owners(self) -> None:
        """Each group's matrices to its ranks, largest Newton-Schulz cost first, each to the least loaded rank
        (the lowest on a tie): a function of the shapes only, so every rank of the group decides alike."""
        by_group: dict[int, list[_Matrix]] = {}
        for matrix in self.matrices:
            if matrix.group is not None:
                by_group.setdefault(id(matrix.group), []).append(matrix)
        steps = self.settings.steps
        for matrices in by_group.values():
            load = [0] * len(matrices[0].pieces)
            order = sorted(range(len(matrices)), key=lambda i: -newton_schulz_flops(*matrices[i].param.shape, steps))
            for index in order:
                owner = min(range(len(load)), key=lambda q: (load[q], q))
                matrices[index].owner = owner
                load[owner] += newton_schulz_flops(*matrices[index].param.shape, steps)

    # -- the step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def _step_other_ranges(self, lr: float, weight_decay: float | None) -> None:
        if weight_decay is not None:
            self.weight_decay = weight_decay
        mu = self.momentum
        directions = []
        for matrix in self.matrices:
            if matrix.owned is None:
                directions.append(None)
                continue
            if self.weight_decay:
                matrix.master.mul_(1.0 - lr * self.weight_decay)
            grad = matrix.owned.grad
            matrix.momentum.lerp_(grad, 1.0 - mu)
            directions.append(grad.lerp(matrix.momentum, mu) if self.nesterov else matrix.momentum)
        whole = [self._gather_at_owner(matrix, d) for matrix, d in zip(self.matrices, directions)]
        updates = [None if w is None else self._update(matrix, w) for matrix, w in zip(self.matrices, whole)]
        for matrix, update in zip(self.matrices, updates):
            piece = self._scatter_from_owner(matrix, update)
            if matrix.owned is not None:
                matrix.master.add_(piece, alpha=-lr)
        self.muon_steps += 1

    def _update(self, matrix: _Matrix, flat: torch.Tensor) -> torch.Tensor:
        """The flat update of this rank's TP shard of `matrix` from the whole shard's flat direction."""
        param, spec = matrix.param, matrix.param.spec
        local = flat.view(param.shape)
        is_qkv = matrix.name.endswith("linear_qkv.weight")
        tp_rank, tp_size = self.pstate.tensor_split.of(spec)  # routed experts: over the expert-TP ranks
        tp_group = self.pstate.group("etp" if spec.expert else "tp")
        split = spec.tp_dim is not None and tp_size > 1
        if split and self.tp_mode == "duplicated":
            whole = mappings.all_gather_along_dim(local, tp_group, spec.tp_dim)
            update = orthogonalized_update(whole, self.settings, is_qkv=is_qkv)
            update = update.chunk(tp_size, dim=spec.tp_dim)[tp_rank]
        elif split and self.tp_mode == "distributed":
            update = orthogonalized_update(local, self.settings, is_qkv=is_qkv, tp_dim=spec.tp_dim,
                                           tp_group=tp_group, tp_size=tp_size)
        else:
            update = orthogonalized_update(local, self.settings, is_qkv=is_qkv)
        return update.reshape(-1)

    def _gather_at_owner(self, matrix: _Matrix, piece: torch.Tensor | None) -> torch.Tensor | None:
        """The whole flat direction at the owner (None elsewhere), from every rank's elements of it."""
        if matrix.group is None:
            return piece
        padded = torch.zeros(matrix.width, dtype=torch.float32, device=matrix.param.device)
        if piece is not None:
            padded[:piece.numel()].copy_(piece)
        owner = matrix.rank == matrix.owner
        gathered = [torch.empty_like(padded) for _ in matrix.pieces] if owner else None
        mappings.gather_to(padded, gathered, dist.get_global_rank(matrix.group, matrix.owner), matrix.group)
        if not owner:
            return None
        return torch.cat([g[:stop - start] for g, (start, stop) in zip(gathered, matrix.pieces)])

    def _scatter_from_owner(self, matrix: _Matrix, update: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's elements of the owner's flat update (None when it steps none)."""
        if matrix.group is None:
            return update
        pieces = None
        if matrix.rank == matrix.owner:
            pieces = [torch.zeros(matrix.width, dtype=torch.float32, device=update.device) for _ in matrix.pieces]
            for padded, (start, stop) in zip(pieces, matrix.pieces):
                padded[:stop - start].copy_(update[start:stop])
        out = torch.empty(matrix.width, dtype=torch.float32, device=matrix.param.device)
        mappings.scatter_from(out, pieces, dist.get_global_rank(matrix.group, matrix.owner), matrix.group)
        start, stop = matrix.pieces[matrix.rank]
        return out[:stop - start] if matrix.owned is not None else None

    # -- checkpoints and memory -----------------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """Adam's entries (optim/distributed_optimizer.py) plus `optimizer.state.momentum_buffer.<name>` and the
        fp32 masters of low-precision Muon matrices; `optimizer.step`: the applied steps."""
        state = super().sharded_state_dict()
        for matrix in self.matrices:
            if matrix.owned is None:
                continue
            flat_range = (matrix.owned.start, matrix.owned.stop)
            spec = matrix.param.spec
            state[f"optimizer.state.momentum_buffer.{matrix.name}"] = FlatShard(matrix.momentum, spec, flat_range)
            if matrix.owned.model_data.dtype != torch.float32:
                state[f"optimizer.state.fp32_param.{matrix.name}"] = FlatShard(matrix.master, spec, flat_range)
        state["optimizer.step"] = self.muon_steps
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        super().load_sharded_state_dict(state)
        self.muon_steps = int(state["optimizer.step"])

    def memory_footprint(self) -> dict[str, int]:
        """As AdamW's, with Muon's momentum buffers among the moments."""
        footprint = super().memory_footprint()
        footprint["moments"] += storage_bytes([m.momentum for m in self.matrices if m.momentum is not None])
        return footprint


class MuonOptimizer(_MuonSteps, Optimizer):
    """Muon and AdamW on whole parameters (every data-parallel rank steps alike)."""

    def __init__(self, params, config: Config, pstate: ParallelState):
        super().__init__(params, config.optimizer, pstate)
        self._setup_muon(config)

    def _matrices(self) -> list[_Matrix]:
        return [_Matrix(name, p, None, 0, [(0, p.numel())]) for p, name in self.names.items() if uses_muon(name, p)]


class DistributedMuonOptimizer(_MuonSteps, DistributedOptimizer):
    """Muon and AdamW on this rank's owned ranges of the buckets (ZeRO-1/2/3), each matrix orthogonalised by
    one data-parallel rank."""

    def __init__(self, model_chunks, config: Config, pstate: ParallelState):
        super().__init__(model_chunks, config.optimizer, pstate)
        self._setup_muon(config)

    def _matrices(self) -> list[_Matrix]:
        matrices = []
        for chunk in self.model_chunks:
            for bucket in chunk.buckets:
                size = 1 if bucket.group is None else dist.get_world_size(bucket.group)
                for param in bucket.params:
                    name = self.names[param]
                    if not uses_muon(name, param):
                        continue
                    offset = bucket.offsets[param]
                    pieces = [(min(max(q * bucket.shard_size - offset, 0), param.numel()),
                               min(max((q + 1) * bucket.shard_size - offset, 0), param.numel()))
                              for q in range(size)]
                    group = bucket.group if size > 1 else None
                    rank = dist.get_rank(bucket.group) if group is not None else 0
                    matrices.append(_Matrix(name, param, group, rank, pieces if group is not None
                                            else [(0, param.numel())]))
        return matrices


def build_muon_optimizer(config: Config, model_chunks, pstate: ParallelState, sharded: bool) -> Optimizer:
    """--optimizer muon for the run's data-parallel sharding strategy."""
    if sharded:
        return DistributedMuonOptimizer(model_chunks, config, pstate)
    named = [(name, p) for chunk in model_chunks for name, p in chunk.module.named_global_parameters()
             if p.requires_grad]
    return MuonOptimizer(named, config, pstate)
