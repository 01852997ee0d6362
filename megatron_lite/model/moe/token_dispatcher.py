"""MoE token dispatchers: carry each token to the ranks holding its experts and the results back.

Expert parallelism puts E / ep experts on each rank of the expert-parallel (EP) group; a token routed to
expert e must reach rank e // (E / ep). Both dispatchers take this rank's tokens [T, h] with their routing
(probabilities, expert indices and an optional capacity mask, all [T, k]) and return the inputs of the
local experts sorted by expert, the number of rows per local expert (a device tensor), and a handle that
`combine` uses to return the expert outputs, weighted by their routing probabilities and summed per token,
as [T, h].

  alltoall   (Megatron's MoEAlltoAllTokenDispatcher) sort the token copies by expert, exchange the
             counts, then one all_to_all_single with uneven splits sends each rank exactly the tokens
             of its experts; the same exchange in reverse brings the outputs home. Moves T k h values.
  allgather  (MoEAllGatherTokenDispatcher) every rank gathers all tokens of the EP group, computes its
             experts on those routed to them, and a reduce-scatter sums the partial outputs back to the
             owners. Moves ep T h values each way but needs no counts: simple, and fine for small ep.

Permutations are index operations on the device (a stable sort by expert, gathers, index_add), never
loops over experts or ranks. The host reads at most one small tensor per dispatch: the split sizes that
the uneven all-to-all needs (alltoall with ep > 1), or the number of rows that stay (capacity drops with
ep = 1; allgather's rows for this rank's experts). Dropless routing with ep = 1 reads nothing.

Both are autograd-aware: gradients take the reverse path through the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.model.moe.router import count_per_expert
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] expert per assignment (num_experts for one that goes nowhere) -> the assignment ids ordered by
    expert, then position, and the count per expert [num_experts] (those going nowhere sort last)."""
    order = torch.argsort(experts, stable=True)
    return order, count_per_expert(experts, num_experts + 1)[:num_experts]


def segment_ids(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `total` rows laid out as consecutive segments of `counts` rows: each row's segment and its
    place within it."""
    segment = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    starts = counts.cumsum(0) - counts
    return segment, torch.arange(total, device=counts.device) - starts[segment]


def source_to_expert_order(recv_counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows received by (source rank, local expert) blocks, [ep, E_local] rows each -> the row ids in
    (local expert, source rank) order, as the grouped experts want them."""
    ep, local = recv_counts.shape
    segment, place = segment_ids(recv_counts.t().reshape(-1), total)  # expert-major blocks
    expert, source = segment // ep, segment % ep
    source_major_starts = recv_counts.reshape(-1).cumsum(0) - recv_counts.reshape(-1)
    return source_major_starts[source * local + expert] + place


@dataclass
class DispatchHandle:
    """What `combine` needs to undo a dispatch: the assignments in the order their tokens were sent."""

    order: torch.Tensor  # [N] assignment ids (row-major in [T', k]) in sorted-by-expert order
    probs: torch.Tensor  # [T', k] routing probabilities (T' = T, or ep T for the allgather dispatcher)
    num_tokens: int  # T'
    send_splits: list[int] | None = None  # alltoall: tokens sent to each EP rank
    recv_splits: list[int] | None = None  # alltoall: tokens received from each EP rank
    expert_order: torch.Tensor | None = None  # alltoall: received row ids in (local expert, source) order


def _weighted_sum_per_token(expert_outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """[N, h] outputs of the sorted assignments -> [T', h]: sum over each token's experts of prob x output."""
    topk = handle.probs.shape[1]
    probs = handle.probs.reshape(-1)[handle.order].to(expert_outputs.dtype)
    weighted = expert_outputs * probs.unsqueeze(-1)
    out = expert_outputs.new_zeros((handle.num_tokens, expert_outputs.shape[-1]))
    return out.index_add(0, handle.order // topk, weighted)


def _routed_experts(indices: torch.Tensor, keep: torch.Tensor | None, nowhere: int) -> torch.Tensor:
    """[T k] each assignment's expert, or `nowhere` for a dropped one."""
    experts = indices.reshape(-1)
    return experts if keep is None else torch.where(keep.reshape(-1), experts, nowhere)


class MoEAlltoAllTokenDispatcher:
    """Token exchange by all-to-all over the EP group (uneven splits)."""

    def __init__(self, num_experts: int, pstate: ParallelState):
        self.num_experts = num_experts
        self.ep_group = pstate.group("ep")
        self.ep_size = pstate.ep_size
        self.num_local_experts = num_experts // pstate.ep_size

    def dispatch(self, tokens, probs, indices, keep) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """[T, h] -> the local experts' inputs [M, h] sorted by local expert, rows per expert [E_local], a handle."""
        topk = indices.shape[1]
        order, counts = sort_by_expert(_routed_experts(indices, keep, self.num_experts), self.num_experts)
        if self.ep_group is None:
            if keep is not None:
                order = order[:int(counts.sum())]  # the kept copies: the one host read
            return tokens[order // topk], counts, DispatchHandle(order, probs, tokens.shape[0])
        recv_counts = mappings.all_to_all_single(counts, self.ep_group).view(self.ep_size, self.num_local_experts)
        host = torch.cat([counts, recv_counts.reshape(-1)]).tolist()  # the one host read: split sizes
        send = host[:self.num_experts]
        send_splits = [sum(send[r * self.num_local_experts:(r + 1) * self.num_local_experts])
                       for r in range(self.ep_size)]
        received_blocks = host[self.num_experts:]
        recv_splits = [sum(received_blocks[r * self.num_local_experts:(r + 1) * self.num_local_experts])
                       for r in range(self.ep_size)]
        order = order[:sum(send_splits)]
        received = mappings.all_to_all(tokens[order // topk], self.ep_group, recv_splits, send_splits)  # [M, h]
        expert_order = source_to_expert_order(recv_counts, sum(recv_splits))
        handle = DispatchHandle(order, probs, tokens.shape[0], send_splits, recv_splits, expert_order)
        return received[expert_order], recv_counts.sum(0), handle

    def combine(self, expert_outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Local experts' outputs [M, h] -> this rank's tokens [T, h] (probability-weighted sum)."""
        if handle.expert_order is not None:
            by_source = torch.empty_like(handle.expert_order)
            by_source[handle.expert_order] = torch.arange(handle.expert_order.numel(), device=by_source.device)
            expert_outputs = mappings.all_to_all(expert_outputs[by_source], self.ep_group, handle.send_splits,
                                                 handle.recv_splits)  # [N, h] in this rank's sorted order
        return _weighted_sum_per_token(expert_outputs, handle)


class MoEAllGatherTokenDispatcher:
    """Token exchange by all-gather over the EP group, outputs summed back by reduce-scatter."""

    def __init__(self, num_experts: int, pstate: ParallelState):
        self.ep_group = pstate.group("ep")
        self.num_local_experts = num_experts // pstate.ep_size
        self.first_local_expert = pstate.ep_rank * self.num_local_experts

    def dispatch(self, tokens, probs, indices, keep) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """[T, h] -> the local experts' inputs [M, h] sorted by local expert, rows per expert [E_local], a handle."""
        # [T, .] -> [ep T, .]: the dim-0 gather whose backward sums the ranks' partial gradients.
        all_tokens = mappings.gather_from_sequence_parallel_region(tokens, self.ep_group)
        all_probs = mappings.gather_from_sequence_parallel_region(probs, self.ep_group)
        all_indices = mappings.all_gather_dim0(indices, self.ep_group)
        local = all_indices - self.first_local_expert
        elsewhere = (local < 0) | (local >= self.num_local_experts)
        local = local.masked_fill(elsewhere, self.num_local_experts)
        all_keep = None if keep is None else mappings.all_gather_dim0(keep, self.ep_group)
        order, counts = sort_by_expert(_routed_experts(local, all_keep, self.num_local_experts),
                                       self.num_local_experts)
        order = order[:int(counts.sum())]  # the copies this rank's experts take: the one host read
        handle = DispatchHandle(order, all_probs, all_tokens.shape[0])
        return all_tokens[order // indices.shape[1]], counts, handle

    def combine(self, expert_outputs: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Local experts' outputs [M, h] -> this rank's tokens [T, h] (probability-weighted sum)."""
        partial = _weighted_sum_per_token(expert_outputs, handle)  # [ep T, h]: this rank's experts only
        return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.ep_group)  # -> [T, h]


TOKEN_DISPATCHERS = {"alltoall": MoEAlltoAllTokenDispatcher, "allgather": MoEAllGatherTokenDispatcher}
