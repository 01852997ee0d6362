"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5 (--experimental-attention-variant
gated_delta_net), in the layers --linear-attention-freq picks.

    x -> in_proj -> q, k, v, z (output gate), b (write strength), a (decay)
    q, k, v -> causal depthwise convolution (--linear-conv-kernel-dim) -> SiLU; q, k L2-normalized per head
    beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias) -> the gated delta rule (delta_rule.py)
    -> RMSNorm of each value head, times SiLU(z) -> out_proj

Each of the `linear_num_key_heads` query/key heads serves linear_num_value_heads / linear_num_key_heads value
heads. The projection's rows are laid out per key head, [q, k, v, z, b, a] for each key head and the value heads
it serves, and the convolution's channels per key head, [q, k, v]; tensor parallelism splits the key heads, so
each rank's contiguous slice of both holds whole heads, the rule runs on local heads with no communication, and
the output projection is row-parallel, as in softmax attention.

Documents in a packed sequence (--reset-attention-mask): the convolution reads no token of an earlier document
and the rule's state restarts at each document's first token.

Context parallelism (any --cp-comm-type): an all-to-all after the input projection turns the sequence split into a
key-head split, as Ulysses attention does (model/attention/context_parallel.py); each cp rank runs the
convolution and the rule over the whole sequence for 1/cp of its key heads, with their slice of the
convolution's and the decay's parameters, and a second all-to-all returns its tokens with all heads before the
output projection. Megatron-Core runs Gated DeltaNet under CP the same way.

In training the rule keeps only its inputs for backward and computes its chunks again there (as fused
kernels do): its [C, C] intermediates per chunk and head would otherwise outweigh the rest of the layer. With
--recompute-granularity selective the whole core, from the projections' output to the gated output (convolution,
norms, decays, rule), is recomputed in backward from its input, as softmax attention's core is.

In generation the layer is given its recurrent state (inference/generation.py's LayerRecurrentState): the tokens
continue the state and the convolution's inputs left by the tokens before, and leave theirs.

Initialization is the model's: the projections and the convolution normal, A_log 0 (A = 1) and dt_bias 1, the
norm's weight 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.linear_attention.delta_rule import CHUNK_SIZE, chunk_gated_delta_rule
from megatron_lite.model.recurrent_mixer import RecurrentMixer
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.model.short_convolution import causal_depthwise_conv, continued_depthwise_conv, document_starts
from megatron_lite.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.state import ParallelState


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dimension, in fp32 (flash-linear-attention's l2norm)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _rule_output(q, k, v, g, beta, scale: float, resets, chunk_size: int) -> torch.Tensor:
    """The delta rule's output alone (training needs no final state), a function for the checkpoint."""
    return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, resets=resets, chunk_size=chunk_size)[0]


class GatedDeltaNet(RecurrentMixer):
    """The token mixer of a linear-attention layer (model/recurrent_mixer.py: its units are the key heads)."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool):
        super().__init__(config, pstate)
        tp = pstate.tp_size
        self.key_heads = config.linear_num_key_heads // tp // self.cp_size  # those this rank computes
        self.values_per_key = config.linear_num_value_heads // config.linear_num_key_heads
        self.value_heads = self.key_heads * self.values_per_key
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.eps = config.norm_epsilon
        group = self.values_per_key
        self.split_sizes = [self.key_dim, self.key_dim, group * self.value_dim, group * self.value_dim, group, group]
        per_key_head = sum(self.split_sizes)
        self.in_proj = ColumnParallelLinear(config.hidden_size, config.linear_num_key_heads * per_key_head, pstate,
                                            bias=False, sequence_parallel=sequence_parallel)
        conv_channels = config.linear_num_key_heads * (2 * self.key_dim + group * self.value_dim)
        self.conv1d_weight = new_parameter(ShardSpec((conv_channels, 1, config.linear_conv_kernel_dim), tp_dim=0), tp)
        heads = config.linear_num_value_heads
        self.A_log = new_parameter(ShardSpec((heads,), tp_dim=0, init="zeros"), tp)
        self.dt_bias = new_parameter(ShardSpec((heads,), tp_dim=0, init="ones"), tp)
        self.norm_weight = new_parameter(ShardSpec((self.value_dim,), init="ones", sequence_parallel=tp > 1), 1)
        self.out_proj = RowParallelLinear(heads * self.value_dim, config.hidden_size, pstate, bias=False,
                                          sequence_parallel=sequence_parallel)

    def _core(self, mixed: torch.Tensor, ids: torch.Tensor | None, recurrent_state) -> torch.Tensor:
        """The projections' output [s, b, key heads, ..] -> the gated, normalised output of the delta rule [s, b,
        value heads, dv]: what --recompute-granularity selective recomputes in backward, keeping only its input."""
        s, b = mixed.shape[:2]
        q, k, v, z, write, decay = mixed.split(self.split_sizes, dim=-1)
        qkv = torch.cat([q, k, v], dim=-1).reshape(s, b, -1)
        conv_weight, A_log, dt_bias = self._context_parallel_share(self.conv1d_weight, self.A_log, self.dt_bias)
        if recurrent_state is None:
            qkv = causal_depthwise_conv(qkv, conv_weight, ids)
        else:
            qkv = continued_depthwise_conv(qkv, self.conv1d_weight, recurrent_state)
        qkv = F.silu(qkv)
        q, k, v = qkv.view(s, b, self.key_heads, -1).split(self.split_sizes[:3], dim=-1)
        q = l2_normalize(q).repeat_interleave(self.values_per_key, dim=2)  # [s, b, value heads, dk]
        k = l2_normalize(k).repeat_interleave(self.values_per_key, dim=2)
        v = v.reshape(s, b, self.value_heads, self.value_dim)
        beta = torch.sigmoid(write.reshape(s, b, self.value_heads).float())
        g = -A_log.float().exp() * F.softplus(decay.reshape(s, b, self.value_heads).float() + dt_bias)
        rule_inputs = [t.transpose(0, 1) for t in (q, k, v, g, beta)]
        resets = None if ids is None else document_starts(ids)
        chunk = min(CHUNK_SIZE, s)  # a short input: one chunk
        if recurrent_state is not None:
            out, recurrent_state.state = chunk_gated_delta_rule(*rule_inputs, scale=self.key_dim ** -0.5,
                                                                initial_state=recurrent_state.state, chunk_size=chunk)
        elif torch.is_grad_enabled() and not self.recompute_core:  # the chunks' [C, C] intermediates are remade
            # in backward, not kept (with the whole core recomputed, they live only during this layer's backward)
            out = checkpoint(_rule_output, *rule_inputs, self.key_dim ** -0.5, resets, chunk, use_reentrant=False)
        else:
            out = _rule_output(*rule_inputs, self.key_dim ** -0.5, resets, chunk)
        out = out.transpose(0, 1)  # [s, b, value heads, dv]
        normed = F.rms_norm(out.float(), (self.value_dim,), self.norm_weight.float(), self.eps)
        return (normed * F.silu(z.reshape(s, b, self.value_heads, self.value_dim).float())).to(mixed.dtype)
