"""The dense feed-forward block: fc1 (column-parallel) -> GELU, squared ReLU or SwiGLU -> fc2 (row-parallel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.fp8 import FP8Recipe
from megatron_lite.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_lite.parallel.state import ParallelState


def activation(config: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """GELU (exact, or GPT-2's tanh form) or squared ReLU (--squared-relu) on fc1's output, or a gated unit on its
    [gate; up] halves: act(gate) x (up + --glu-linear-offset), act SiLU (SwiGLU) or quick GELU (--quick-geglu), the
    halves first clamped by --activation-func-clamp-value (gate at most it, up within +-it: gpt-oss's clamped
    SwiGLU)."""
    if config.squared_relu:
        return F.relu(x).square()
    if not config.gated_linear_unit:
        return F.gelu(x, approximate="tanh" if config.openai_gelu else "none")
    gate, up = x.chunk(2, dim=-1)
    limit = config.activation_func_clamp_value
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    gated = gate * torch.sigmoid(1.702 * gate) if config.quick_geglu else F.silu(gate)
    return gated * (up + config.glu_linear_offset) if config.glu_linear_offset else gated * up


class MLP(torch.nn.Module):
    """h -> ffn -> h. With SwiGLU, fc1 produces [gate; up] (2 x ffn); each TP rank holds its slice of both. `fp8`:
    both linears' GEMMs in FP8."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool,
                 fp8: FP8Recipe | None = None):
        super().__init__()
        self.config = config
        ffn = config.ffn_hidden_size
        bias = not config.disable_bias_linear
        chunks = 2 if config.gated_linear_unit else 1
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, chunks * ffn, pstate, bias=bias,
                                               sequence_parallel=sequence_parallel, tp_chunks=chunks, fp8=fp8)
        self.linear_fc2 = RowParallelLinear(ffn, config.hidden_size, pstate, bias=bias,
                                            sequence_parallel=sequence_parallel, fp8=fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.config, self.linear_fc1(x)))
