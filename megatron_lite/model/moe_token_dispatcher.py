"""MoE token dispatchers: carry each token to the ranks holding its experts and the results back.

Expert parallelism puts E / ep experts on each rank of the expert-parallel (EP) group; a token routed to
expert e must reach rank e // (E / ep). Both dispatchers take this rank's tokens [T, h] with their routing
(probabilities, expert indices and an optional capacity mask, all [T, k]) and return the inputs of the
local experts sorted by expert, plus a handle that `combine` uses to return the expert outputs, weighted by
their routing probabilities and summed per token, as [T, h].

  alltoall   (Megatron's MoEAlltoAllTokenDispatcher) sort the token copies by expert, exchange the
             counts, then one all_to_all_single with uneven splits sends each rank exactly the tokens
             of its experts; the same exchange in reverse brings the outputs home. Moves T k h values.
  allgather  (MoEAllGatherTokenDispatcher) every rank gathers all tokens of the EP group, computes its
             experts on those routed to them, and a reduce-scatter sums the partial outputs back to the
             owners. Moves ep T h values each way but needs no counts: simple, and fine for small ep.

Both are autograd-aware: gradients take the reverse path through the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


def sort_by_expert(indices: torch.Tensor, selected: torch.Tensor | None) -> torch.Tensor:
    """Ids (row-major positions in [T, k]) of the selected assignments, ordered by expert, then token."""
    flat_experts = indices.reshape(-1)
    ids = torch.arange(flat_experts.numel(), device=indices.device)
    if selected is not None:
        ids = ids[selected.reshape(-1)]
    return ids[torch.argsort(flat_experts[ids], stable=True)]


@dataclass
class DispatchHandle:
    """What `combine` needs to undo a dispatch: the assignments in the order their tokens were sent."""

    order: torch.Tensor  # [N] assignment ids (row-major in [T', k]) in sorted-by-expert order
    probs: torch.Tensor  # [T', k] routing probabilities (T' = T, or ep T for the allgather dispatcher)
    num_tokens: int  # T'
    send_splits: list[int] | None = None  # alltoall: tokens sent to each EP rank
    recv_splits: list[int] | None = None  # alltoall: tokens received from each EP rank
    recv_counts: torch.Tensor | None = None  # alltoall: [ep, E / ep] tokens from each rank per local expert


def _weighted_sum_per_token(expert_outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """[N, h] outputs of the sorted assignments -> [T', h]: sum over each token's experts of prob x output."""
    topk = handle.probs.shape[1]
    probs = handle.probs.reshape(-1)[handle.order].to(expert_outputs.dtype)
    weighted = expert_outputs * probs.unsqueeze(-1)
    out = expert_outputs.new_zeros((handle.num_tokens, expert_outputs.shape[-1]))
    return out.index_add(0, handle.order // topk, weighted)


class MoEAlltoAllTokenDispatcher:
    """Token exchange by all-to-all over the EP group (uneven splits)."""

    def __init__(self, num_experts: int, pstate: ParallelState):
        self.num_experts = num_experts
        self.ep_group = pstate.group("ep")
        self.ep_size = pstate.ep_size
        self.num_local_experts = num_experts // pstate.ep_size

    def dispatch(self, tokens, probs, indices, keep) -> tuple[torch.Tensor, list[int], DispatchHandle]:
        """[T, h] -> the local experts' inputs [M, h] sorted by local expert, their counts, a handle."""
        order = sort_by_expert(indices, keep)
        counts = torch.bincount(indices.reshape(-1)[order], minlength=self.num_experts)  # [E] sent per expert
        permuted = tokens[order // indices.shape[1]]  # [N, h] one copy per kept assignment, by expert
        recv_counts = mappings.all_to_all_single(counts, self.ep_group).view(self.ep_size, self.num_local_experts)
        send_splits = counts.view(self.ep_size, self.num_local_experts).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = mappings.all_to_all(permuted, self.ep_group, recv_splits, send_splits)  # [M, h]
        # Received rows come by (source rank, local expert); the experts want them by (local expert, source).
        chunks = received.split(recv_counts.reshape(-1).tolist())
        by_expert = [chunks[source * self.num_local_experts + j]
                     for j in range(self.num_local_experts) for source in range(self.ep_size)]
        handle = DispatchHandle(order, probs, tokens.shape[0], send_splits, recv_splits, recv_counts)
        return torch.cat(by_expert), recv_counts.sum(0).tolist(), handle

    def combine(self, expert_outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Local experts' outputs [M, h] -> this rank's tokens [T, h] (probability-weighted sum)."""
        chunks = expert_outputs.split(handle.recv_counts.t().reshape(-1).tolist())  # by (local expert, source)
        by_source = [chunks[j * self.ep_size + source]
                     for source in range(self.ep_size) for j in range(self.num_local_experts)]
        returned = mappings.all_to_all(torch.cat(by_source), self.ep_group, handle.send_splits,
                                       handle.recv_splits)  # [N, h] in this rank's sorted order
        return _weighted_sum_per_token(returned, handle)


class MoEAllGatherTokenDispatcher:
    """Token exchange by all-gather over the EP group, outputs summed back by reduce-scatter."""

    def __init__(self, num_experts: int, pstate: ParallelState):
        self.ep_group = pstate.group("ep")
        self.num_local_experts = num_experts // pstate.ep_size
        self.first_local_expert = pstate.ep_rank * self.num_local_experts

    def dispatch(self, tokens, probs, indices, keep) -> tuple[torch.Tensor, list[int], DispatchHandle]:
        """[T, h] -> the local experts' inputs [M, h] sorted by local expert, their counts, a handle."""
        # [T, .] -> [ep T, .]: the dim-0 gather whose backward sums the ranks' partial gradients.
        all_tokens = mappings.gather_from_sequence_parallel_region(tokens, self.ep_group)
        all_probs = mappings.gather_from_sequence_parallel_region(probs, self.ep_group)
        all_indices = mappings.all_gather_dim0(indices, self.ep_group)
        local = all_indices - self.first_local_expert
        selected = (local >= 0) & (local < self.num_local_experts)
        if keep is not None:
            selected &= mappings.all_gather_dim0(keep, self.ep_group)
        order = sort_by_expert(all_indices, selected)
        counts = torch.bincount(local.reshape(-1)[order], minlength=self.num_local_experts)
        handle = DispatchHandle(order, all_probs, all_tokens.shape[0])
        return all_tokens[order // indices.shape[1]], counts.tolist(), handle

    def combine(self, expert_outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Local experts' outputs [M, h] -> this rank's tokens [T, h] (probability-weighted sum)."""
        partial = _weighted_sum_per_token(expert_outputs, handle)  # [ep T, h]: this rank's experts only
        return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.ep_group)  # -> [T, h]


TOKEN_DISPATCHERS = {"alltoall": MoEAlltoAllTokenDispatcher, "allgather": MoEAllGatherTokenDispatcher}
