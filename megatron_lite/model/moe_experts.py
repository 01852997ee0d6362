"""The experts of an MoE layer: the local routed experts as one grouped GEMM, and the shared expert.

Each expert keeps its own weights under its global name (`mlp.experts.<e>.linear_fc1.weight`), so
initialization and checkpoints do not depend on the layout. A forward stacks the local experts' weights
and multiplies every expert's tokens at once:
  torch._grouped_mm   where the installed torch has it for the device and dtype (CUDA: bf16 on Hopper and
                      newer; recent CPU builds: fp32 and bf16) and rows are multiples of 16 bytes; the
                      group offsets stay on the device: no host read and no padding
  padded bmm          elsewhere: each expert's rows are placed in a [E_local, longest, in] batch by index
                      ops and multiplied with one torch.bmm; the longest group is read back once (the one
                      read of the expert compute, only where the grouped kernel cannot run)

Tensor parallelism splits expert weights as the dense MLP's (fc1 by output rows, [gate; up] halves
separately for SwiGLU; fc2 by input columns); the outputs are partial sums over TP that the MoE layer
reduces once. The shared expert (--moe-shared-expert-intermediate-size, DeepSeek / Qwen2-MoE) is such an
MLP that every token runs; Qwen2-MoE scales its output by sigmoid(x w_gate) (--moe-shared-expert-gate).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model.mlp import activation
from megatron_lite.model.sharding import ShardSpec, new_parameter


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch has torch._grouped_mm for `dtype` on `device_type` (tried once on a tiny input:
    CPU kernels came later than CUDA's, and CUDA's needs bf16 on compute capability 9.0 or newer)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(2, 8, device=device_type, dtype=dtype)
        torch._grouped_mm(x, torch.zeros(1, 8, 8, device=device_type, dtype=dtype),
                          offs=torch.tensor([2], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm runs these operands: it exists for their device and dtype, and their rows are a
    multiple of 16 bytes."""
    aligned = 16 // x.element_size()
    return (x.dtype == weight.dtype and x.shape[-1] % aligned == 0 and weight.shape[1] % aligned == 0
            and grouped_mm_runs(x.device.type, x.dtype))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (torch._grouped_mm's backward rejects the
    broadcast gradients that, e.g., a sum produces)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[N, in] rows sorted by group, weights [G, out, in], rows per group [G] (on the device) -> [N, out]:
    rows of group g times weight[g]^T."""
    if grouped_mm_applies(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets))
    return padded_grouped_linear(x, weight, counts)


def padded_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`grouped_linear` as one torch.bmm over groups padded to the longest."""
    groups, rows = weight.shape[0], x.shape[0]
    starts = counts.cumsum(0) - counts
    group = torch.repeat_interleave(torch.arange(groups, device=x.device), counts, output_size=rows)
    position = torch.arange(rows, device=x.device) - starts[group]
    longest = int(counts.max()) if rows else 0  # the padding's length: a host read
    padded = x.new_zeros(groups, longest, x.shape[1]).index_put((group, position), x)
    return torch.bmm(padded, weight.transpose(1, 2))[group, position]


class ExpertLinear(torch.nn.Module):
    """One weight of an expert, this TP rank's slice; no communication (the MoE layer does it once)."""

    def __init__(self, spec: ShardSpec, tp_size: int):
        super().__init__()
        self.weight = new_parameter(spec, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ExpertMLP(torch.nn.Module):
    """h -> ffn -> h with GELU or SwiGLU, no biases: [n, h] -> [n, h], a partial sum over TP. A routed
    expert (`expert=True`: gradients reduced over the expert-data-parallel group) or the shared one."""

    def __init__(self, config: ModelConfig, tp_size: int, ffn: int, *, expert: bool):
        super().__init__()
        self.config = config
        h, chunks = config.hidden_size, 2 if config.swiglu else 1
        self.linear_fc1 = ExpertLinear(ShardSpec((chunks * ffn, h), tp_dim=0, tp_chunks=chunks, expert=expert),
                                       tp_size)
        self.linear_fc2 = ExpertLinear(ShardSpec((h, ffn), tp_dim=1, init="scaled_normal", expert=expert), tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.config, self.linear_fc1(x)))


class GroupedExperts(torch.nn.ModuleList):
    """This rank's E / ep routed experts (ExpertMLPs, indexed as local experts), run as grouped GEMMs."""

    def __init__(self, config: ModelConfig, tp_size: int, num_local_experts: int):
        super().__init__(ExpertMLP(config, tp_size, config.moe_ffn_hidden_size, expert=True)
                         for _ in range(num_local_experts))
        self.config = config

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """[N, h] rows sorted by local expert, [E_local] rows per expert (on the device) -> [N, h]."""
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self])  # [E_local, chunks ffn / tp, h]
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self])  # [E_local, h, ffn / tp]
        hidden = activation(self.config, grouped_linear(x, fc1, tokens_per_expert))
        return grouped_linear(hidden, fc2, tokens_per_expert)


class SharedExpertMLP(ExpertMLP):
    """The expert every token runs: [T, h] (the tensor-parallel region's tokens) -> [T, h], a partial sum
    over TP. Its optional gate [1, h] is replicated and sees every token on every TP rank, so its gradient,
    taken against this rank's partial output, is summed over TP (ShardSpec.sequence_parallel)."""

    def __init__(self, config: ModelConfig, tp_size: int):
        super().__init__(config, tp_size, config.moe_shared_expert_intermediate_size, expert=False)
        self.gate_weight = (new_parameter(ShardSpec((1, config.hidden_size), sequence_parallel=True), 1)
                            if config.moe_shared_expert_gate else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(F.linear(x, self.gate_weight))
