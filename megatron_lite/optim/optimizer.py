"""AdamW over the model's main gradients, with global-norm clipping and fp32 master weights.

The optimizer never sees `param.grad`: gradients live in the contiguous `main_grad` buffers that data
parallelism reduces. For parameters kept in bf16/fp16 it steps fp32 master copies and casts back.
Weight decay is decoupled (AdamW) and skipped for norms and biases (every 1-D parameter), as in
Megatron. The gradient norm is global over all ranks with each replicated parameter counted once.
"""

from __future__ import annotations

import math

import torch

from megatron_lite.checkpoint.sharded import ShardedTensor, shard_boxes
from megatron_lite.config import OptimizerConfig
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


def counted_once(param: torch.nn.Parameter, pstate: ParallelState) -> bool:
    """Whether this rank's copy of `param` enters the global norm: replicas across TP are counted on TP
    rank 0 only, the last stage's copy of tied embeddings not at all (the first stage counts it)."""
    if getattr(param, "is_embedding_copy", False):
        return False
    return param.spec.tp_dim is not None or pstate.tp_rank == 0


def global_grad_norm(grads_and_replication: list[tuple[list[torch.Tensor], int]], pstate: ParallelState,
                     device) -> float:
    """L2 norm over every rank's gradients; each list is held identically by `replication` ranks."""
    squares = torch.zeros(len(grads_and_replication), dtype=torch.float64, device=device)
    for index, (grads, _) in enumerate(grads_and_replication):
        for grad in grads:
            squares[index] += grad.detach().double().pow(2).sum()
    mappings.all_reduce(squares, pstate.group("world"))
    replication = torch.tensor([r for _, r in grads_and_replication], dtype=torch.float64, device=device)
    return math.sqrt(float((squares / replication).sum()))


class Optimizer:
    """AdamW on (master copies of) this rank's parameters, fed by their main gradients."""

    def __init__(self, params: list[torch.nn.Parameter], config: OptimizerConfig, pstate: ParallelState):
        self.config = config
        self.pstate = pstate
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in params]
        decay = [m for p, m in zip(params, self.masters) if p.ndim > 1]
        no_decay = [m for p, m in zip(params, self.masters) if p.ndim <= 1]
        groups = [{"params": decay, "weight_decay": config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = bool(params) and params[0].is_cuda
        self.adam = torch.optim.AdamW([g for g in groups if g["params"]], lr=config.lr,
                                      betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                                      fused=fused or None)

    def grad_norm(self) -> float:
        device = self.params[0].device if self.params else "cpu"
        dense = [p.main_grad for p in self.params if not p.spec.expert and counted_once(p, self.pstate)]
        expert = [p.main_grad for p in self.params if p.spec.expert and counted_once(p, self.pstate)]
        return global_grad_norm([(dense, self.pstate.dp_size * self.pstate.cp_size),
                                 (expert, self.pstate.layout.edp)], self.pstate, device)

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Clip, update and return the gradient norm before clipping."""
        norm = self.grad_norm()
        clip = self.config.clip_grad / (norm + 1e-6) if self.config.clip_grad > 0 else 1.0
        for param, master in zip(self.params, self.masters):
            master.grad = param.main_grad.float() * min(clip, 1.0)
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        for param, master in zip(self.params, self.masters):
            master.grad = None
            if master is not param:
                param.copy_(master)
        return norm

    def state_dict(self) -> dict:
        return self.adam.state_dict()

    def _init_state(self) -> None:
        """Create Adam's state as its first step would (zero moments, step 0), so it can be loaded into."""
        for group in self.adam.param_groups:
            for master in group["params"]:
                state = self.adam.state[master]
                if not state:
                    on_device = group["fused"] or group["capturable"]
                    state["step"] = torch.zeros((), dtype=torch.float32, device=master.device if on_device else "cpu")
                    state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)

    def sharded_state_dict(self, global_names: dict[torch.nn.Parameter, str]) -> list[ShardedTensor]:
        """Adam's state as boxes of layout-independent global tensors, views of the live state.

        Keys follow Megatron's distributed optimizer: `optimizer.state.{exp_avg,exp_avg_sq}.<global name>`,
        `optimizer.state.fp32_param.<global name>` for parameters kept in bf16/fp16 (an fp32 parameter is
        its own master and is saved with the model), and the step count `optimizer.step`. Loading fills
        these views in place; `load_sharded_state_dict` then finishes the load.
        """
        self._init_state()
        tp_rank, tp_size = self.pstate.tp_rank, self.pstate.tp_size
        pieces = []
        for param, master in zip(self.params, self.masters):
            state = self.adam.state[master]
            tensors = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
            if master is not param:
                tensors["fp32_param"] = master
            for kind, tensor in tensors.items():
                pieces += shard_boxes(f"optimizer.state.{kind}.{global_names[param]}", param.spec, tp_rank, tp_size,
                                      tensor)
        if self.masters:
            pieces.append(ShardedTensor.whole("optimizer.step", self.adam.state[self.masters[0]]["step"]))
        return pieces

    @torch.no_grad()
    def load_sharded_state_dict(self, pieces: list[ShardedTensor]) -> None:
        """Finish a load into the views of `sharded_state_dict`: share the step count, refresh the
        low-precision parameters from their masters."""
        step = next((p.data for p in pieces if p.key == "optimizer.step"), None)
        for param, master in zip(self.params, self.masters):
            if step is not None:
                self.adam.state[master]["step"].copy_(step)
            if master is not param:
                param.copy_(master)

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state)
