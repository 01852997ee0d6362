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
from megatron_lite.model.mamba.ssd import CHUNK_SIZE, ssd_chunked
from megatron_lite.model.recurrent_mixer import RecurrentMixer
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


class Mamba2Mixer(RecurrentMixer):
    """The token mixer of a Mamba-2 layer (model/recurrent_mixer.py: its units are the groups)."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool):
        super().__init__(config, pstate)
        tp = pstate.tp_size
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

    def _core(self, mixed: torch.Tensor, ids: torch.Tensor | None, recurrent_state) -> torch.Tensor:
        """The projection's output [s, b, groups, ..] -> the gated, normalised scan output [s, b, groups, heads of
        the group x p]: what --recompute-granularity selective recomputes in backward, keeping only its input."""
        s, b = mixed.shape[:2]
        z, xs, B, C, dt = mixed.split(self.split_sizes, dim=-1)
        xbc = torch.cat([xs, B, C], dim=-1).reshape(s, b, -1)
        conv_weight, conv_bias, A_log, D, dt_bias, norm_weight = self._context_parallel_share(
            self.conv1d_weight, self.conv1d_bias, self.A_log, self.D, self.dt_bias, self.norm_weight)
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
