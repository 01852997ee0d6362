"""MoE routing: a linear gate picks each token's top-k experts; the balancing losses join the backward pass.

Routing (Megatron's TopKRouter, computed in fp32):
  default (Mixtral)   top-k of the logits, softmax over those k: the k probabilities sum to one
  --moe-router-pre-softmax  softmax over all experts, then the top-k probabilities as they are

Auxiliary losses, both on the router's full softmax p_t = softmax(logits_t) over the T tokens of a
micro-batch:
  load balancing (Switch / GShard)  coeff * E * sum_i f_i * P_i, with f_i the fraction of the T k
                                    assignments routed to expert i and P_i the mean of p_t[i]
  z-loss (ST-MoE)                   coeff * mean_t logsumexp(logits_t)^2

A micro-batch's tokens may be split across ranks (the sequence over TP with sequence parallelism, over
CP with context parallelism). The expert counts are summed over those ranks and each rank computes its
share of the two sums, so the shares add up to the single-device losses and each rank's gradient is
exactly the single-device gradient of its own tokens.

The losses are not returned to the training loop: `MoEAuxLossAutoScaler` (Megatron's name) attaches
them to the router's output so that the backward pass of the language-model loss also differentiates
them, on whatever pipeline stage the layer lives. The language-model loss is a sum over tokens that
finalize_model_grads divides by the global token count N, so the losses enter with weight T: the
gradient is that of mean LM loss + sum over micro-batches of (T / N) * (aux + z), i.e. mean LM loss
plus the token-weighted mean of the per-micro-batch losses.

Capacity (`--moe-expert-capacity-factor c`): each expert takes at most ceil(c * T k / E) of the T
tokens of a micro-batch; it keeps those it gives the highest probability (ties: the earlier token), the
others skip the expert (with every choice dropped, a token passes through the residual connection only).
The decision depends on the micro-batch's routing alone, so every layout drops the same token copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


@dataclass
class RouterLosses:
    """This rank's shares of one micro-batch's balancing losses (coefficients applied), and counts."""

    aux_loss: torch.Tensor  # [] differentiable
    z_loss: torch.Tensor  # [] differentiable
    tokens_per_expert: torch.Tensor  # [E] assignments of this rank's tokens, before capacity drops
    num_tokens: float  # tokens of the whole micro-batch, T


def topk_routing(logits: torch.Tensor, topk: int, pre_softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> probabilities [T, k] and expert indices [T, k] (Mixtral or pre-softmax)."""
    if pre_softmax:
        return torch.topk(torch.softmax(logits, dim=-1), topk, dim=-1)
    top_logits, indices = torch.topk(logits, topk, dim=-1)
    return torch.softmax(top_logits, dim=-1), indices


def load_balancing_loss(router_probs: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: float,
                        topk: int, coeff: float) -> torch.Tensor:
    """coeff * E * sum_i f_i P_i: this rank's share, from its [T_local, E] probabilities and the
    micro-batch's expert counts [E] (f_i = count_i / (T k), P_i = sum_t p_t[i] / T)."""
    num_experts = router_probs.shape[-1]
    fraction_routed = tokens_per_expert / (num_tokens * topk)
    mean_prob_share = router_probs.sum(dim=0) / num_tokens
    return coeff * num_experts * (fraction_routed * mean_prob_share).sum()


def z_loss(logits: torch.Tensor, num_tokens: float, coeff: float) -> torch.Tensor:
    """coeff * mean_t logsumexp(logits_t)^2: this rank's share of the micro-batch's mean."""
    return coeff * torch.logsumexp(logits, dim=-1).square().sum() / num_tokens


class MoEAuxLossAutoScaler(torch.autograd.Function):
    """Identity on `output`; its backward also feeds d(total)/d(aux_loss) = `scale` into `aux_loss`'s graph
    and calls `on_backward` (which records the layer's statistics once per trained micro-batch, never for
    evaluation or a recomputed forward)."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float, on_backward):
        ctx.save_for_backward(aux_loss)
        ctx.scale, ctx.on_backward = scale, on_backward
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        ctx.on_backward()
        return grad_output, torch.full_like(aux_loss, ctx.scale), None, None


class TopKRouter(torch.nn.Module):
    """Linear gate [E, h], replicated on every rank; with sequence parallelism it sees this rank's slice
    of the sequence, so its gradient is a partial sum over TP (ShardSpec.sequence_parallel)."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool):
        super().__init__()
        self.topk = config.moe_router_topk
        self.pre_softmax = config.moe_router_pre_softmax
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.z_loss_coeff = config.moe_z_loss_coeff
        # Groups over which one micro-batch's tokens are split.
        self.token_groups = [g for g in (pstate.group("tp") if sequence_parallel else None, pstate.group("cp"))
                             if g is not None]
        self.weight = new_parameter(
            ShardSpec((config.num_experts, config.hidden_size), sequence_parallel=sequence_parallel), 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterLosses]:
        """[s, b, h] (this rank's tokens) -> probabilities [s b, k], expert indices [s b, k], losses."""
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), self.weight.float())  # [T_local, E] fp32
        probs, indices = topk_routing(logits, self.topk, self.pre_softmax)
        local_counts = torch.bincount(indices.reshape(-1), minlength=logits.shape[-1]).to(logits.dtype)
        counts = local_counts.clone()
        for group in self.token_groups:
            mappings.all_reduce(counts, group)
        num_tokens = float(counts.sum()) / self.topk
        aux = load_balancing_loss(torch.softmax(logits, dim=-1), counts, num_tokens, self.topk,
                                  self.aux_loss_coeff)
        return probs, indices, RouterLosses(aux, z_loss(logits, num_tokens, self.z_loss_coeff), local_counts,
                                            num_tokens)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Most tokens one expert takes from `num_tokens` tokens: ceil(c * T k / E), as Megatron."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def capacity_keep_mask(probs: torch.Tensor, indices: torch.Tensor, num_experts: int,
                       capacity_factor: float) -> torch.Tensor:
    """[T, k] bool: which assignments fit their expert's capacity (highest probability first, then the
    earlier token), a deterministic function of the micro-batch's routing."""
    num_tokens, topk = indices.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    gates = torch.zeros(num_tokens, num_experts, device=probs.device).scatter(1, indices, probs.detach().float())
    routed = torch.zeros_like(gates, dtype=torch.bool).scatter(1, indices, True)
    order = torch.sort(gates, dim=0, descending=True, stable=True).indices  # [T, E] tokens by preference
    positions = torch.arange(num_tokens, device=probs.device).unsqueeze(1).expand(-1, num_experts)
    place = torch.empty_like(order).scatter_(0, order, positions)  # [T, E] place of token t in expert e's queue
    return (routed & (place < capacity)).gather(1, indices)
