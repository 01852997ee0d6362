"""The Mamba-2 token mixer (Dao and Gu, 2024) of NVIDIA's hybrid models (Nemotron-H, Nemotron 3), in the layers
`M` of --hybrid-layer-pattern.

    x -> in_proj -> z (gate), x, B, C (groups of heads share B and C), dt (per head)
    x, B, C -> causal depthwise convolution (kernel 4, with bias) -> SiLU
    dt -> softplus(dt + dt_bias); A = -exp(A_log) -> the selective scan with D's skip (ssd.py)
    -> y SiLU(z), RMS-normalised over each group's channels (the gated grouped norm) -> out_proj

Sizes (Megatron-Core's flags): --mamba-num-heads heads (default 2 x hidden / head dim) of --mamba-head-dim
channels, --mamba-num-groups groups of heads sharing B and C of --mamba-state-dim each.

The projection's rows are laid out per group, [z, x, B, C, dt] of the group and its heads, and the convolution's
channels per group, [x, B, C]; tensor parallelism splits the groups, so each rank's contiguous slice of every
parameter holds whole groups (their heads, their B and C), the scan and the grouped norm run on local groups with
no communication, and the output projection is row-parallel, as in softmax attention.

Documents in a packed sequence (--reset-attention-mask): the convolution reads no token of an earlier document
and the scan's state restarts at each document's first token.

Context parallelism (any --cp-comm-type): an all-to-all after the input projection turns the sequence split into a
group split (Megatron-Core's mamba_context_parallel.py does the same, as Gated DeltaNet here); each cp rank runs the
convolution, the scan and the gated norm over the whole sequence for 1/cp of its groups, with their slice of the
per-group and per-head parameters, and a second all-to-all returns its tokens with all groups before the output
projection.

In training the scan keeps only its inputs for backward and computes its chunks again there (its [L, L] masks per
chunk and head would otherwise outweigh the rest of the layer). With --recompute-granularity selective the whole
core, from the projection's output to the gated norm's output, is recomputed in backward from its input.

In generation the layer is given its recurrent state (inference/generation.py's LayerRecurrentState): the tokens
continue the scan's state and the convolution's inputs left by the tokens before, and leave theirs.

Initialization: the projections and the convolution normal (the output projection scaled by depth), the
convolution's bias 0, A_log log(1 .. heads) (A = -1 .. -heads), D 1, the norm's weight 1, and dt_bias such that
softplus(dt_bias) runs from 0.001 to 0.1 over the heads, log-spaced (Megatron draws them from that range).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.context_parallel import heads_to_sequence, sequence_to_heads
from megatron_lite.model.mamba.ssd import CHUNK_SIZE, ssd_chunked
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.model.short_convolution import causal_depthwise_conv, continued_depthwise_conv, document_starts
from megatron_lite.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.state import ParallelState

CONV_KERNEL = 4  # Megatron-Core's d_conv and every Nemotron-H checkpoint's


def mamba_num_heads(config: ModelConfig) -> int:
    """--mamba-num-heads, or Megatron's default: twice the hidden size in heads of --mamba-head-dim."""
    return config.mamba_num_heads or 2 * config.hidden_size // config.mamba_head_dim


def _scan(x, dt, A, B, C, D, resets, chunk_size: int) -> torch.Tensor:
    """The scan's output alone (training needs no final state), a function for the checkpoint."""
    return ssd_chunked(x, dt, A, B, C, D, resets=resets, chunk_size=chunk_size)[0]


class Mamba2Mixer(torch.nn.Module):
    """The token mixer of a Mamba-2 layer: [s, b, h] -> [s, b, h] (sequence slices under sequence parallelism),
    called as softmax attention is, with the layer's positions (their documents are used)."""

    keeps_recurrent_state = True  # generation gives it a LayerRecurrentState, not a KV cache

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool):
        super().__init__()
        tp = pstate.tp_size
        self.cp_group, self.cp_size, self.cp_rank = pstate.group("cp"), pstate.cp_size, pstate.cp_rank
        heads, groups = mamba_num_heads(config), config.mamba_num_groups
        self.groups = groups // tp // self.cp_size  # those this rank computes
        self.heads_per_group = heads // groups
        self.heads = self.groups * self.heads_per_group
        self.head_dim, self.state_dim = config.mamba_head_dim, config.mamba_state_dim
        channels = self.heads_per_group * self.head_dim  # z or x of one group
        self.split_sizes = [channels, channels, self.state_dim, self.state_dim, self.heads_per_group]
        self.group_channels = channels + 2 * self.state_dim  # the convolution's channels of one group
        bias = not config.disable_bias_linear
        self.in_proj = ColumnParallelLinear(config.hidden_size, groups * sum(self.split_sizes), pstate, bias=bias,
                                            sequence_parallel=sequence_parallel)
        self.conv1d_weight = new_parameter(ShardSpec((groups * self.group_channels, 1, CONV_KERNEL), tp_dim=0), tp)
        self.conv1d_bias = new_parameter(ShardSpec((groups * self.group_channels,), tp_dim=0, init="zeros"), tp)
        self.A_log = new_parameter(ShardSpec((heads,), tp_dim=0, init="log_arange"), tp)
        self.D = new_parameter(ShardSpec((heads,), tp_dim=0, init="ones"), tp)
        self.dt_bias = new_parameter(ShardSpec((heads,), tp_dim=0, init="mamba_dt"), tp)
        self.norm_weight = new_parameter(ShardSpec((heads * self.head_dim,), tp_dim=0, init="ones"), tp)
        self.out_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, pstate, bias=bias,
                                          sequence_parallel=sequence_parallel)
        self.eps = config.norm_epsilon
        self.recompute_core = config.recompute_granularity == "selective"

    def forward(self, x: torch.Tensor, positions=None, recurrent_state=None) -> torch.Tensor:
        ids = positions.documents.ids.to(x.device) if positions is not None and positions.documents else None
        mixed = self.in_proj(x)  # [s, b, groups/tp * per group]
        mixed = mixed.view(*mixed.shape[:2], -1, sum(self.split_sizes))
        if self.cp_size > 1:  # [s/cp, b, groups/tp, ..] -> [s, b, groups/tp/cp, ..], the whole sequence
            mixed = sequence_to_heads(mixed.transpose(0, 1), self.cp_group, self.cp_size).transpose(0, 1)
        if self.recompute_core and recurrent_state is None and torch.is_grad_enabled():
            y = checkpoint(self._core, mixed, ids, None, use_reentrant=False)
        else:
            y = self._core(mixed, ids, recurrent_state)
        if self.cp_size > 1:  # back to this rank's tokens, with all its groups
            y = heads_to_sequence(y.transpose(0, 1), self.cp_group, self.cp_size).transpose(0, 1)
        return self.out_proj(y.reshape(*y.shape[:2], -1))

    def _core(self, mixed: torch.Tensor, ids: torch.Tensor | None, recurrent_state) -> torch.Tensor:
        """The projection's output [s, b, groups, ..] -> the gated, normalised scan output [s, b, groups, heads of
        the group x p]: what --recompute-granularity selective recomputes in backward, keeping only its input."""
        s, b = mixed.shape[:2]
        z, xs, B, C, dt = mixed.split(self.split_sizes, dim=-1)
        xbc = torch.cat([xs, B, C], dim=-1).reshape(s, b, -1)
        conv_weight, conv_bias, A_log, D, dt_bias, norm_weight = self._local_group_parameters()
        if recurrent_state is None:
            xbc = causal_depthwise_conv(xbc, conv_weight, ids)
        else:
            xbc = continued_depthwise_conv(xbc, conv_weight, recurrent_state)
        xbc = F.silu(xbc + conv_bias)
        xs, B, C = xbc.view(s, b, self.groups, -1).split(self.split_sizes[1:4], dim=-1)
        scan_inputs = [xs.reshape(s, b, self.heads, self.head_dim), B, C,
                       F.softplus(dt.reshape(s, b, self.heads).float() + dt_bias.float())]
        xs, B, C, dt = (t.transpose(0, 1) for t in scan_inputs)  # [b, s, ..]
        A = -A_log.float().exp()
        resets = None if ids is None else document_starts(ids)
        chunk = min(CHUNK_SIZE, s)
        if recurrent_state is not None:
            y, recurrent_state.state = ssd_chunked(xs, dt, A, B, C, D, initial_state=recurrent_state.state,
                                                   chunk_size=chunk)
        elif torch.is_grad_enabled() and not self.recompute_core:  # the chunks' masks are remade in backward
            y = checkpoint(_scan, xs, dt, A, B, C, D, resets, chunk, use_reentrant=False)
        else:
            y = _scan(xs, dt, A, B, C, D, resets, chunk)
        y = y.transpose(0, 1).reshape(s, b, self.groups, -1).float() * F.silu(z.float())
        normed = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)  # over each group's channels
        return (normed * norm_weight.float().view(self.groups, -1)).to(mixed.dtype)

    def _local_group_parameters(self) -> tuple[torch.Tensor, ...]:
        """The convolution's weight and bias, A_log, D, dt_bias and the norm's weight of the groups this rank
        computes: all of its tensor-parallel shard, or under context parallelism the cp rank's part of it (the
        parameters are whole on every cp rank; each one's gradient reaches only its part, and the data-parallel
        reduction over cp sums them)."""
        params = (self.conv1d_weight, self.conv1d_bias, self.A_log, self.D, self.dt_bias, self.norm_weight)
        if self.cp_size == 1:
            return params
        return tuple(p.view(self.cp_size, -1, *p.shape[1:])[self.cp_rank] for p in params)
