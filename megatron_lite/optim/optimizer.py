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

With --optimizer-cpu-offload the masters and moments of a share of the ranges live in host memory and are
stepped there (optim/cpu_offload.py): `parts` are the masters on the device and those on the host, each
stepped by an AdamW of its own; gradient norm, clipping and the overflow check stay on the device.
"""

from __future__ import annotations

import math

import torch

from megatron_lite.config.sections import OptimizerConfig
from megatron_lite.model.sharding import FlatShard
from megatron_lite.optim.cpu_offload import DeviceMasters, HostMasters, offloaded_count
from megatron_lite.optim.loss_scaler import build_grad_scaler
from megatron_lite.optim.param_and_grad_buffer import OwnedRange, storage_bytes
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


def counted_once(param: torch.nn.Parameter, pstate: ParallelState) -> bool:
    """Whether this rank's copy of `param` enters the global norm: replicas across TP (across expert TP for an
    expert's) are counted on its rank 0 only, the last stage's copy of tied embeddings not at all (the first stage
    counts it)."""
    if param.spec.tied_copy:
        return False
    return param.spec.tp_dim is not None or (pstate.etp_rank if param.spec.expert else pstate.tp_rank) == 0


def global_grad_norm(grads_and_replication: list[tuple[list[torch.Tensor], int]], pstate: ParallelState,
                     device) -> torch.Tensor:
    """L2 norm over every rank's gradients, each list held identically by `replication` ranks: a 0-dim fp64
    tensor on `device`, read by nobody here, so computing it costs no host synchronisation.

    Per-tensor norms come from one fused `_foreach_norm` per list; only their squares are summed in fp64,
    so that a large finite norm cannot overflow into a false inf."""
    squares = torch.zeros(len(grads_and_replication), dtype=torch.float64, device=device)
    for index, (grads, replication) in enumerate(grads_and_replication):
        if grads:  # a replica's share, so that the sum over all ranks counts each gradient once
            squares[index] = torch.stack(torch._foreach_norm(grads)).double().square().sum() / replication
    mappings.all_reduce(squares, pstate.group("world"))
    return squares.sum().sqrt()


def _whole(param: torch.nn.Parameter) -> OwnedRange:
    return OwnedRange(param, 0, param.numel(), param.main_grad.view(-1), param.detach().view(-1))


def build_adamw(part: DeviceMasters | HostMasters, config: OptimizerConfig,
                stepped=None) -> torch.optim.AdamW | None:
    """AdamW over `part`'s masters (those of the ranges `stepped(range)` accepts, if given; None when that is
    none), its state allocated now (memory and checkpoints see it from the start). Weight decay is skipped for
    1-D parameters (norms, biases); wd_mult, as in Megatron, is the share of the scheduled weight decay a group
    takes."""
    members = [(r, m) for r, m in zip(part.ranges, part.masters) if stepped is None or stepped(r)]
    decay = [m for r, m in members if r.param.ndim > 1]
    no_decay = [m for r, m in members if r.param.ndim <= 1]
    if not members:
        return None
    groups = [{"params": decay, "weight_decay": config.weight_decay, "wd_mult": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "wd_mult": 0.0}]
    adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr,
                             betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                             fused=part.fused_adam or None)
    for master in decay + no_decay:
        step = torch.zeros((), dtype=torch.float32, device=master.device if part.fused_adam else "cpu")
        adam.state[master] = {"step": step, "exp_avg": torch.zeros_like(master), "exp_avg_sq": torch.zeros_like(master)}
    return adam


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
        offloaded = 0
        if config.optimizer_cpu_offload:
            offloaded = offloaded_count([r.stop - r.start for r in self.ranges], config.optimizer_offload_fraction)
        self.host_masters = HostMasters(self.ranges[:offloaded]) if offloaded else None
        self.device_masters = DeviceMasters(self.ranges[offloaded:])
        self.parts = [part for part in (self.host_masters, self.device_masters) if part is not None and part.ranges]
        self.adams = [build_adamw(part, config, self._steps_with_adam) for part in self.parts]
        self.grad_scaler = build_grad_scaler(config)

    # -- what a subclass changes ----------------------------------------------------------------------
    def _owned_ranges(self, params: list[torch.nn.Parameter]) -> list[OwnedRange]:
        return [_whole(p) for p in params]

    def _replication(self) -> tuple[int, int]:
        """How many ranks hold each dense and each expert gradient this rank steps."""
        return self.pstate.dp_size * self.pstate.cp_size, self.pstate.edp_size

    def _sync_params(self) -> None:
        """Make the updated values visible to the model everywhere (nothing to do without sharding)."""

    def _steps_with_adam(self, owned: OwnedRange) -> bool:
        """Whether AdamW steps this range (all of them here; Muon keeps the hidden matrices)."""
        return True

    def _step_other_ranges(self, lr: float, weight_decay: float | None) -> None:
        """Step the ranges AdamW does not, with the masters' gradients clipped (none here)."""

    # -- the step -------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """What the schedule multiplies the loss by before backward."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def _grads(self) -> list[torch.Tensor]:
        return [r.grad for r in self.ranges]

    def _states(self):
        """(owned range, its fp32 master, its Adam state) for every range AdamW steps on this rank."""
        for part, adam in zip(self.parts, self.adams):
            for owned, master in zip(part.ranges, part.masters):
                if adam is not None and master in adam.state:
                    yield owned, master, adam.state[master]

    def grad_norm(self) -> torch.Tensor:
        device = self.ranges[0].grad.device if self.ranges else "cpu"
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
        for part, adam in zip(self.parts, self.adams):
            if adam is None:
                continue
            for master, grad in zip(part.masters, part.grads_for_step()):
                master.grad = grad
            for group in adam.param_groups:
                group["lr"] = lr
                if weight_decay is not None:
                    group["weight_decay"] = weight_decay * group["wd_mult"]
            adam.step()
            for master in part.masters:
                master.grad = None
        self._step_other_ranges(lr, weight_decay)
        self._copy_masters_to_model()
        self._sync_params()
        return True

    def step(self, lr: float) -> tuple[bool, float]:
        """`prepare_grads` then `apply`: (whether the update happened, gradient norm before clipping)."""
        grad_norm = float(self.prepare_grads())
        return self.apply(lr, grad_norm), grad_norm

    def _copy_masters_to_model(self) -> None:
        for part in self.parts:
            part.copy_to_model()

    def _masters(self):
        """(owned range, its fp32 master) for every range this rank steps."""
        for part in self.parts:
            yield from zip(part.ranges, part.masters)

    @torch.no_grad()
    def reload_model_params(self, only_fp32: bool = False) -> None:
        """Set the masters from the model's current weights (after loading weights without optimizer state);
        `only_fp32`: only those of fp32 weights, which checkpoints hold as the weights themselves."""
        for owned, master in self._masters():
            if master is not owned.model_data and (owned.model_data.dtype == torch.float32 or not only_fp32):
                master.copy_(owned.model_data)

    # -- checkpoints ----------------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's optimizer state, by layout-independent key (see distributed_optimizer.py):
        `optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<global name>` -> FlatShard (live tensors),
        `optimizer.step` -> int, `optimizer.grad_scaler` -> dict or None."""
        state, steps = {}, []
        for owned, master, adam in self._states():
            name = self.names[owned.param]
            if name is None:
                raise ValueError("build the optimizer from (global name, parameter) pairs to checkpoint it")
            tensors = {"exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
            if owned.model_data.dtype != torch.float32:  # an fp32 weight is its own master, saved with the model
                tensors["fp32_param"] = master
            for kind, tensor in tensors.items():
                state[f"optimizer.state.{kind}.{name}"] = FlatShard(tensor, owned.param.spec, (owned.start, owned.stop))
            steps.append(int(adam["step"]))
        state["optimizer.step"] = steps[0] if steps else 0
        state["optimizer.grad_scaler"] = None if self.grad_scaler is None else self.grad_scaler.state_dict()
        return state

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict) -> None:
        """Load what `sharded_state_dict` describes (its FlatShards filled in place, or equal ones), then
        update the model's weights from the loaded masters (the masters of fp32 weights from the loaded
        weights, when they are separate copies on the host)."""
        for key, live in self.sharded_state_dict().items():
            if isinstance(live, FlatShard) and state[key].data is not live.data:
                live.data.copy_(state[key].data)
        for _, _, adam in self._states():
            adam["step"].fill_(state["optimizer.step"])
        self.reload_model_params(only_fp32=True)
        if self.grad_scaler is not None and state.get("optimizer.grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["optimizer.grad_scaler"])
        self._copy_masters_to_model()
        self._sync_params()

    def memory_footprint(self) -> dict[str, int]:
        """Bytes this optimizer holds on the model's device beyond the model: fp32 masters of low-precision
        weights, Adam moments (what --optimizer-cpu-offload keeps in host memory is not counted)."""
        return self._footprint(self.device_masters)

    def host_memory_footprint(self) -> dict[str, int]:
        """Bytes --optimizer-cpu-offload holds in host memory: masters, moments, the gradients' arrival
        buffers and the low-precision weights' outgoing ones (all zero without offload)."""
        if self.host_masters is None:
            return {"master": 0, "moments": 0, "grads": 0, "outgoing": 0}
        return {**self._footprint(self.host_masters), **self.host_masters.buffer_bytes()}

    def _footprint(self, part: DeviceMasters | HostMasters) -> dict[str, int]:
        adam = self.adams[self.parts.index(part)] if part in self.parts else None
        adam = {} if adam is None else adam.state
        moments = [adam[m][k] for m in part.masters if m in adam for k in ("exp_avg", "exp_avg_sq")]
        return {"master": storage_bytes(part.footprint()), "moments": storage_bytes(moments)}
