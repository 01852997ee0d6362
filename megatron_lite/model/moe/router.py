"""MoE routing: a linear gate picks each token's top-k experts; the balancing losses join the backward pass.

Routing (Megatron's TopKRouter, computed in fp32), by --moe-router-score-function:
  softmax (Mixtral)   top-k of the logits, softmax over those k: the k probabilities sum to one
    --moe-router-pre-softmax  softmax over all experts, then the top-k probabilities as they are
  sigmoid (DeepSeek-V3)  each expert scored sigmoid(logit) on its own; the top-k scores, divided by their
                      sum when k > 1. With --moe-router-enable-expert-bias a per-expert bias b is added to
                      the scores for choosing the experts only; the probabilities stay the unbiased scores
Then --moe-router-topk-scaling-factor multiplies the k probabilities. Group-limited routing
(--moe-router-num-groups G, --moe-router-group-topk g): the E experts form G groups of consecutive
experts, each group is ranked by the sum of its k / g best scores, and a token chooses among the experts of
its g best groups only.

Auxiliary losses on the router's scores over all experts, p_t = softmax(logits_t) (or the sigmoid scores
divided by their sum), for the T tokens of a micro-batch, by --moe-router-load-balancing-type:
  aux_loss (Switch / GShard)  coeff * E * sum_i f_i * P_i, with f_i the fraction of the T k
                              assignments routed to expert i and P_i the mean of p_t[i]
  seq_aux_loss (DeepSeek-V2/V3)  the same within each sequence of the micro-batch, averaged over the b
                              sequences
  none                        no balancing loss
and the z-loss (ST-MoE), coeff * mean_t logsumexp(logits_t)^2.

A micro-batch's tokens may be split across ranks (the sequence over TP with sequence parallelism, over
CP with context parallelism). The expert counts are summed over those ranks and each rank computes its
share of the sums, so the shares add up to the single-device losses and each rank's gradient is
exactly the single-device gradient of its own tokens. The number of tokens comes from the shapes, so
routing reads nothing back from the device.

The losses are not returned to the training loop: `MoEAuxLossAutoScaler` (Megatron's name) attaches
them to the router's output so that the backward pass of the language-model loss also differentiates
them, on whatever pipeline stage the layer lives, with the weight model/loss_scaling.py gives them. By
default the gradient is that of the mean over the global batch's micro-batches of (mean LM loss + aux + z);
with --calculate-per-token-loss, of the LM loss's mean over all N unmasked tokens + the sum over
micro-batches of (T / N) * (aux + z), the token-weighted mean of the per-micro-batch losses.

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

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


@dataclass
class RouterLosses:
    """This rank's shares of one micro-batch's balancing losses (coefficients applied), and counts."""

    aux_loss: torch.Tensor  # [] differentiable
    z_loss: torch.Tensor  # [] differentiable
    tokens_per_expert: torch.Tensor  # [E] assignments of this rank's tokens, before capacity drops
    num_tokens: int  # tokens of the whole micro-batch, T


@dataclass(frozen=True)
class RoutingChoice:
    """How scores become the k experts and probabilities of a token (the router's options)."""

    topk: int
    score_function: str = "softmax"
    pre_softmax: bool = False
    scaling_factor: float | None = None
    num_groups: int | None = None
    group_topk: int | None = None


def count_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[..] expert indices -> [E] int64 counts, on the device (bincount would read its maximum back)."""
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat))


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int | None, group_topk: int | None):
    """torch.topk over the experts of each row's `group_topk` best groups (all experts when ungrouped)."""
    if num_groups is None:
        return torch.topk(scores, k, dim=-1)
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(-1)  # [T, G]
    chosen_groups = group_scores.topk(group_topk, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~allowed, float("-inf")), k, dim=-1)


def topk_routing(logits: torch.Tensor, choice: RoutingChoice,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> probabilities [T, k] and expert indices [T, k]."""
    k, groups = choice.topk, (choice.num_groups, choice.group_topk)
    if choice.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        selection = scores if expert_bias is None else scores + expert_bias
        indices = group_limited_topk(selection.detach(), k, *groups).indices
        probs = scores.gather(1, indices)
        if k > 1:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    elif choice.pre_softmax:
        probs, indices = group_limited_topk(torch.softmax(logits, dim=-1), k, *groups)
    else:
        top_logits, indices = group_limited_topk(logits, k, *groups)
        probs = torch.softmax(top_logits, dim=-1)
    if choice.scaling_factor is not None:
        probs = probs * choice.scaling_factor
    return probs, indices


def balancing_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """[T, E] the router's distribution over all experts that the balancing loss weighs."""
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(-1, keepdim=True) + 1e-20)
    return torch.softmax(logits, dim=-1)


def load_balancing_loss(router_probs: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: float,
                        topk: int, coeff: float) -> torch.Tensor:
    """coeff * E * sum_i f_i P_i: this rank's share, from its [T_local, E] probabilities and the
    micro-batch's expert counts [E] (f_i = count_i / (T k), P_i = sum_t p_t[i] / T)."""
    num_experts = router_probs.shape[-1]
    fraction_routed = tokens_per_expert / (num_tokens * topk)
    mean_prob_share = router_probs.sum(dim=0) / num_tokens
    return coeff * num_experts * (fraction_routed * mean_prob_share).sum()


def sequence_load_balancing_loss(router_probs: torch.Tensor, tokens_per_expert: torch.Tensor, seq_length: int,
                                 topk: int, coeff: float) -> torch.Tensor:
    """The Switch loss of each sequence, averaged over the b sequences: this rank's share, from its
    [s_local, b, E] probabilities and each sequence's expert counts [b, E] (summed over the ranks)."""
    num_experts, batch = router_probs.shape[-1], router_probs.shape[1]
    fraction_routed = tokens_per_expert / (seq_length * topk)  # [b, E]
    mean_prob_share = router_probs.sum(dim=0) / seq_length  # [b, E]
    return coeff * num_experts * (fraction_routed * mean_prob_share).sum() / batch


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
    """Linear gate [E, h], replicated on every rank, with a bias [E] unless --disable-bias-linear (Megatron's
    add_bias_linear; gpt-oss's router); with sequence parallelism it sees this rank's slice of the sequence, so
    its gradients are partial sums over TP (ShardSpec.sequence_parallel). With
    --moe-router-enable-expert-bias it holds `expert_bias` [E], an fp32 buffer that moe.update_expert_biases
    changes after each iteration, identically on every rank, and that checkpoints carry."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool):
        super().__init__()
        self.choice = RoutingChoice(config.moe_router_topk, config.moe_router_score_function,
                                    config.moe_router_pre_softmax, config.moe_router_topk_scaling_factor,
                                    config.moe_router_num_groups, config.moe_router_group_topk)
        self.num_experts = config.num_experts
        self.load_balancing_type = config.moe_router_load_balancing_type
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.z_loss_coeff = config.moe_z_loss_coeff
        # Groups over which one micro-batch's tokens are split.
        self.token_groups = [g for g in (pstate.group("tp") if sequence_parallel else None, pstate.group("cp"))
                             if g is not None]
        self.token_split = (pstate.tp_size if sequence_parallel else 1) * pstate.cp_size
        self.weight = new_parameter(
            ShardSpec((config.num_experts, config.hidden_size), sequence_parallel=sequence_parallel), 1)
        self.bias = (None if config.disable_bias_linear else
                     new_parameter(ShardSpec((config.num_experts,), sequence_parallel=sequence_parallel), 1))
        self.bias_update_rate = config.moe_router_bias_update_rate
        if config.moe_router_enable_expert_bias:
            bias = torch.zeros(config.num_experts, dtype=torch.float32)
            bias.spec = ShardSpec((config.num_experts,), init="zeros")
            self.register_buffer("expert_bias", bias)
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterLosses]:
        """[s, b, h] (this rank's tokens) -> probabilities [s b, k], expert indices [s b, k], losses."""
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), self.weight.float(), bias)  # [T_local, E] fp32
        probs, indices = topk_routing(logits, self.choice, self.expert_bias)
        local_counts = count_per_expert(indices, self.num_experts)
        num_tokens = logits.shape[0] * self.token_split
        aux = self._balancing_loss(logits, indices, local_counts, x.shape[:2], num_tokens)
        return probs, indices, RouterLosses(aux, z_loss(logits, num_tokens, self.z_loss_coeff), local_counts,
                                            num_tokens)

    def _balancing_loss(self, logits, indices, local_counts, local_shape, num_tokens) -> torch.Tensor:
        if self.load_balancing_type == "none" or not self.aux_loss_coeff:
            return logits.new_zeros(())
        scores = balancing_scores(logits, self.choice.score_function)
        if self.load_balancing_type == "aux_loss":
            counts = self._sum_over_token_groups(local_counts.to(logits.dtype))
            return load_balancing_loss(scores, counts, num_tokens, self.choice.topk, self.aux_loss_coeff)
        s_local, b = local_shape
        per_sequence = torch.zeros(b, self.num_experts, device=logits.device)  # [b, E]
        sequence_of = torch.arange(b, device=logits.device).repeat(s_local).repeat_interleave(self.choice.topk)
        per_sequence.index_put_((sequence_of, indices.reshape(-1)), torch.ones_like(sequence_of, dtype=torch.float),
                                accumulate=True)
        counts = self._sum_over_token_groups(per_sequence)
        return sequence_load_balancing_loss(scores.view(s_local, b, -1), counts, s_local * self.token_split,
                                            self.choice.topk, self.aux_loss_coeff)

    def _sum_over_token_groups(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.clone()
        for group in self.token_groups:
            mappings.all_reduce(counts, group)
        return counts


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
