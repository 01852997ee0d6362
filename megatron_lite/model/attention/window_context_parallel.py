"""Sliding-window and sink attention (window_and_sinks.py) under context parallelism, for every --cp-comm-type.

A rank holds the load-balanced chunks i and 2cp-1-i of the sequence (context_parallel.py). Two ways cover the
comm types:
  a2a              an all-to-all turns the sequence split into a head split (Ulysses, context_parallel.py's
                   sequence_to_heads), the rank attends over the whole sequence for its nh/cp heads with their
                   sinks, and a second all-to-all brings its tokens back with all their heads
  p2p, allgather,  K and V of the whole sequence are all-gathered over the cp group (their gradients reduce-
  a2a+p2p          scattered back in backward, by the autograd-aware mapping) and the rank's queries attend to
                   them at their own positions
The window is not used to skip the keys beyond it: the attention materialises its scores whatever the layout, so
the gathered keys cost memory and traffic of s x ng x d per rank, as --cp-comm-type allgather's do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.model.attention.context_parallel import (
    chunks_to_sequence_order,
    heads_to_sequence,
    load_balanced_indices,
    sequence_to_heads,
)
from megatron_lite.model.attention.window_and_sinks import window_sink_attention
from megatron_lite.parallel import mappings


def context_parallel_window_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group,
                                           comm_type: str, *, window: int | None, sinks: torch.Tensor | None,
                                           document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """q [s/cp, b, nh, d], k/v [s/cp, b, ng, d] of this rank's chunks -> [s/cp, b, nh * d], attending over the
    whole sequence of the cp `group`; `sinks` [nh] of this rank's heads, `document_ids` [b, s] of the whole
    sequence."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if comm_type == "a2a":
        return _heads_split(q, k, v, group, cp, rank, window, sinks, document_ids)
    local = q.shape[0]
    kv = mappings.gather_from_sequence_parallel_region(torch.stack((k, v), dim=1), group)  # [s, 2, b, ng, d]
    k, v = chunks_to_sequence_order(kv, cp).unbind(1)
    positions = load_balanced_indices(local * cp, cp, rank)
    return window_sink_attention(q, k, v, window=window, sinks=sinks, document_ids=document_ids,
                                 query_positions=positions)


def _heads_split(q, k, v, group, cp: int, rank: int, window, sinks, document_ids) -> torch.Tensor:
    """The all-to-all way: [s/cp, b, n, d] -> the whole sequence for n/cp heads, attention, and back."""
    s_local, b, heads, d = q.shape
    if k.shape[2] % cp:  # too few K/V heads to split: one per query head
        k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    q, k, v = (sequence_to_heads(t.transpose(0, 1), group, cp).transpose(0, 1) for t in (q, k, v))  # [s, b, n/cp, d]
    rank_sinks = None if sinks is None else sinks.view(cp, -1)[rank]
    out = window_sink_attention(q, k, v, window=window, sinks=rank_sinks, document_ids=document_ids)
    out = out.view(-1, b, heads // cp, d).transpose(0, 1)  # [b, s, n/cp, d]
    return heads_to_sequence(out, group, cp).transpose(0, 1).reshape(s_local, b, heads * d)
