"""What Gated DeltaNet (model/linear_attention/) and Mamba-2 (model/mamba/) share around their recurrent cores.

Both project the layer's input to units of heads (Gated DeltaNet's key heads with their value heads, Mamba-2's
groups) that tensor parallelism splits whole, run a core over the sequence for each unit (a convolution, then a
recurrence in chunks), and project back row-parallel. Context parallelism turns the sequence split into a unit
split by an all-to-all after the input projection, as Ulysses attention does (model/attention/context_parallel.py)
and as Megatron-Core does for both: each cp rank runs the core over the whole sequence for 1/cp of its units, with
their slice of the per-unit parameters, and a second all-to-all returns its tokens with all units before the output
projection. With --recompute-granularity selective the whole core is recomputed in backward from its input.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.context_parallel import heads_to_sequence, sequence_to_heads
from megatron_lite.parallel.state import ParallelState


class RecurrentMixer(torch.nn.Module):
    """[s, b, h] -> [s, b, h] (sequence slices under sequence parallelism), called as softmax attention is, with
    the layer's positions (their documents are used). A subclass builds `in_proj`, whose output is `split_sizes`
    per unit, and `out_proj`, and defines `_core(mixed [s, b, units, ..], document ids, recurrent state) -> [s, b,
    units, ..]`."""

    keeps_recurrent_state = True  # generation gives it a LayerRecurrentState, not a KV cache

    def __init__(self, config: ModelConfig, pstate: ParallelState):
        super().__init__()
        self.cp_group, self.cp_size, self.cp_rank = pstate.group("cp"), pstate.cp_size, pstate.cp_rank
        self.recompute_core = config.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, positions=None, recurrent_state=None) -> torch.Tensor:
        ids = positions.documents.ids.to(x.device) if positions is not None and positions.documents else None
        mixed = self.in_proj(x)  # [s, b, units/tp * per unit]
        mixed = mixed.view(*mixed.shape[:2], -1, sum(self.split_sizes))
        if self.cp_size > 1:  # [s/cp, b, units/tp, ..] -> [s, b, units/tp/cp, ..], the whole sequence
            mixed = sequence_to_heads(mixed.transpose(0, 1), self.cp_group, self.cp_size).transpose(0, 1)
        if self.recompute_core and recurrent_state is None and torch.is_grad_enabled():
            out = checkpoint(self._core, mixed, ids, None, use_reentrant=False)
        else:
            out = self._core(mixed, ids, recurrent_state)
        if self.cp_size > 1:  # back to this rank's tokens, with all its units
            out = heads_to_sequence(out.transpose(0, 1), self.cp_group, self.cp_size).transpose(0, 1)
        return self.out_proj(out.reshape(*out.shape[:2], -1))

    def _context_parallel_share(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-unit parameters (laid out unit by unit along dim 0) of the units this rank computes: all of its
        tensor-parallel shard, or under context parallelism the cp rank's part of it (the parameters are whole on
        every cp rank; each one's gradient reaches only its part, and the data-parallel reduction over cp sums
        them)."""
        if self.cp_size == 1:
            return params
        return tuple(p.view(self.cp_size, -1, *p.shape[1:])[self.cp_rank] for p in params)
