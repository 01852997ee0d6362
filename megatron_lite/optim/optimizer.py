"""AdamW over the model's main gradients: fp32 masters, loss scaling, global-norm clipping.

The optimizer never sees `param.grad`: gradients live in the contiguous fp32 `main_grad` buffers that
data parallelism reduces. It steps fp32 master copies of bf16/fp16 parameters and casts the result back
(fp32 parameters are their own masters). Weight decay is decoupled (AdamW) and skipped for norms and
biases (every 1-D parameter), as in Megatron. The gradient norm is global over all ranks with each
replicated parameter counted once; it is taken after unscaling and before clipping.

What it steps is a list of `OwnedRange`s: flat element ranges of parameters with their gradient and
storage. This class steps whole parameters (every data-parallel rank does the same update);
`DistributedOptimizer` steps each rank's shard. fp16 runs use a loss scaler (optim/loss_scaler.py): a step
whose gradients overflow on any rank (a global norm that is not finite) is skipped on every rank.
"""

from __future__ import annotations

import math

import torch

from megatron_lite.config import OptimizerConfig
from megatron_lite.model.sharding import FlatShard
from megatron_lite.optim.loss_scaler import build_grad_scaler
from megatron_lite.optim.param_and_grad_buffer import OwnedRange, storage_bytes
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


def counted_once(param: torch.nn.Parameter, pstate: ParallelState) -> bool:
    """Whether this rank's copy of `param` enters the global norm: replicas across TP are counted on TP
    rank 0 only, the last stage's copy of tied embeddings not at all (the first stage counts it)."""
    if param.spec.tied_copy:
        return False
    return param.spec.tp_dim is not None or pstate.tp_rank == 0


def global_grad_norm(grads_and_replication: list[tuple[list[torch.Tensor], int]], pstate: ParallelState,
                     device) -> torch.Tensor:
    """L2 norm over every rank's gradients, each list held identically by `replication` ranks: a 0-dim fp64
    tensor on `device`, read by nobody here, so computing it costs no host synchronisation.

    Per-tensor norms come from one fused `_foreach_norm` per list; only their squares are summed in fp64,
    so that a large finite norm cannot overflow into a false inf."""
    squares = torch.zeros(len(grads_and_replication), dtype=torch.float64, device=device)
    for index, (grads, _) in enumerate(grads_and_replication):
        if grads:
            squares[index] = torch.stack(torch._foreach_norm(grads)).double().square().sum()
    mappings.all_reduce(squares, pstate.group("world"))
    replication = torch.tensor([r for _, r in grads_and_replication], dtype=torch.float64, device=device)
    return (squares / replication).sum().sqrt()


def _whole(param: torch.nn.Parameter) -> OwnedRange:
    return OwnedRange(param, 0, param.numel(), param.main_grad.view(-1), param.detach().view(-1))


class Optimizer:
    """AdamW on (fp32 master copies of) this rank's parameters, fed by their main gradients.

    `params` are parameters with a `main_grad`, or (global name, parameter) pairs, which
    `sharded_state_dict` needs.
    """

    def __init__(self, params, config: OptimizerConfig, pstate: ParallelState):
        self.config = config
        self.pstate = pstate
        named = [(None, p) if isinstance(p, torch.Tensor) else p for p in params]
        self.names = {param: name for name, param in named}
        self.ranges = [r for r in self._owned_ranges([p for _, p in named]) if r.stop > r.start]
        self.masters = [r.model_data if r.model_data.dtype == torch.float32 else r.model_data.float()
                        for r in self.ranges]
        self.grad_scaler = build_grad_scaler(config)
        decay = [m for r, m in zip(self.ranges, self.masters) if r.param.ndim > 1]
        no_decay = [m for r, m in zip(self.ranges, self.masters) if r.param.ndim <= 1]
        # wd_mult, as in Megatron: the share of the scheduled weight decay a group takes
        groups = [{"params": decay, "weight_decay": config.weight_decay, "wd_mult": 1.0},
                  {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
        fused = bool(self.masters) and self.masters[0].is_cuda
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr,
                                      betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                      fused=fused or None)
        for master in self.masters:  # allocated now, so that memory and checkpoints see them from the start
            step = torch.zeros((), dtype=torch.float32, device=master.device if fused else "cpu")
            self.adam.state[master] = {"step": step, "exp_avg": torch.zeros_like(master),
                                       "exp_avg_sq": torch.zeros_like(master)}

    # -- what a subclass changes ----------------------------------------------------------------------
    def _owned_ranges(self, params: list[torch.nn.Parameter]) -> list[OwnedRange]:
        return [_whole(p) for p in params]

    def _replication(self) -> tuple[int, int]:
        """How many ranks hold each dense and each expert gradient this rank steps."""
        return self.pstate.dp_size * self.pstate.cp_size, self.pstate.edp_size

    def _sync_params(self) -> None:
        """Make the updated values visible to the model everywhere (nothing to do without sharding)."""

    # -- the step -------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """What the schedule multiplies the loss by before backward."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def _grads(self) -> list[torch.Tensor]:
        return [r.grad for r in self.ranges]

    def grad_norm(self) -> torch.Tensor:
        device = self.masters[0].device if self.masters else "cpu"
        counted = [r for r in self.ranges if counted_once(r.param, self.pstate)]
        dense, expert = self._replication()
        return global_grad_norm([([r.grad for r in counted if not r.param.spec.expert], dense),
                                 ([r.grad for r in counted if r.param.spec.expert], expert)], self.pstate, device)

    @torch.no_grad()
    def prepare_grads(self) -> torch.Tensor:
        """Divide the gradients by the loss scale; their global norm as a device tensor. The trainer reads it
        together with the loss, in the step's one host synchronisation, and passes it to `apply`."""
        if self.grad_scaler is not None and self.ranges:
            torch._foreach_mul_(self._grads(), 1.0 / self.loss_scale)
        return self.grad_norm()

    @torch.no_grad()
    def apply(self, lr: float, grad_norm: float, weight_decay: float | None = None) -> bool:
        """Clip to --clip-grad and update; whether the update happened. The norm is global, so every rank
        decides alike. Gradients that are not finite are an fp16 overflow (skipped: the loss scaler backs
        off) or, with --check-for-nan-in-loss-and-grad, a step never applied. `weight_decay` is this step's
        (--weight-decay-incr-style); None keeps the one of the previous step (at first --weight-decay)."""
        finite = math.isfinite(grad_norm)
        if self.grad_scaler is not None:
            self.grad_scaler.update(found_inf=not finite)
        if not finite and (self.grad_scaler is not None or self.config.check_for_nan_in_loss_and_grad):
            return False
        clip = self.config.clip_grad / (grad_norm + 1e-6) if self.config.clip_grad > 0 else 1.0
        if clip < 1.0 and self.ranges:
            torch._foreach_mul_(self._grads(), clip)
        for owned, master in zip(self.ranges, self.masters):
            master.grad = owned.grad
        for group in self.adam.param_groups:
            group["lr"] = lr
            if weight_decay is not None:
                group["weight_decay"] = weight_decay * group["wd_mult"]
        self.adam.step()
        for master in self.masters:
            master.grad = None
        self._copy_masters_to_model()
        self._sync_params()
        return True

    def step(self, lr: float) -> tuple[bool, float]:
        """`prepare_grads` then `apply`: (whether the update happened, gradient norm before clipping)."""
        grad_norm = float(self.prepare_grads())
        return self.apply(lr, grad_norm), grad_norm

    def _copy_masters_to_model(self) -> None:
        for owned, master in zip(self.ranges, self.masters):
            if master is not owned.model_data:
                owned.model_data.copy_(master)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Set the masters from the model's current weights (after loading weights without optimizer state)."""
        for owned, master in zip(self.ranges, self.masters):
            if master is not owned.model_data:
                master.copy_(owned.model_data)

    # -- checkpoints ----------------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's optimizer state, by layout-independent key (see distributed_optimizer.py):
        `optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<global name>` -> FlatShard (live tensors),
        `optimizer.step` -> int, `optimizer.grad_scaler` -> dict or None."""
        state = {}
        for owned, master in zip(self.ranges, self.masters):
            name = self.names[owned.param]
            if name is None:
                raise ValueError("build the optimizer from (global name, parameter) pairs to checkpoint it")
            adam = self.adam.state[master]
            tensors = {"exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
            if master is not owned.model_data:  # an fp32 parameter is its own master, saved with the model
                tensors["fp32_param"] = master
            for kind, tensor in tensors.items():
                state[f"optimizer.state.{kind}.{name}"] = FlatShard(tensor, owned.param.spec, (owned.start, owned.stop))
        steps = [int(s["step"]) for s in self.adam.state.values()]
        state["optimizer.step"] = steps[0] if steps else 0
        state["optimizer.grad_scaler"] = None if self.grad_scaler is None else self.grad_scaler.state_dict()
        return state

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict) -> None:
        """Load what `sharded_state_dict` describes (its FlatShards filled in place, or equal ones), then
        update the model's weights from the loaded masters."""
        for key, live in self.sharded_state_dict().items():
            if isinstance(live, FlatShard) and state[key].data is not live.data:
                live.data.copy_(state[key].data)
        for adam in self.adam.state.values():
            adam["step"].fill_(state["optimizer.step"])
        if self.grad_scaler is not None and state.get("optimizer.grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["optimizer.grad_scaler"])
        self._copy_masters_to_model()
        self._sync_params()

    def memory_footprint(self) -> dict[str, int]:
        """Bytes this optimizer holds beyond the model: fp32 masters of low-precision weights, Adam moments."""
        model = {r.model_data.untyped_storage().data_ptr() for r in self.ranges}
        masters = [m for m in self.masters if m.untyped_storage().data_ptr() not in model]
        moments = [s[k] for s in self.adam.state.values() for k in ("exp_avg", "exp_avg_sq")]
        return {"master": storage_bytes(masters), "moments": storage_bytes(moments)}
