"""The experts of an MoE layer: the local routed experts as one grouped GEMM, and the shared expert.

Each expert keeps its own weights under its global name (`mlp.experts.<e>.linear_fc1.weight`), so
initialization and checkpoints do not depend on the layout. A forward stacks the local experts' weights
and multiplies every expert's tokens at once (the stacked copy is made again in backward rather than kept):
  torch._grouped_mm   where the installed torch has a kernel for the device and dtype (CUDA: the fused one,
                      bf16 on Hopper and newer; recent CPU builds: fp32 and bf16) and rows are multiples of
                      16 bytes; the group offsets stay on the device: no host read and no padding
  padded bmm          elsewhere: each expert's rows are placed in a [E_local, longest, in] batch by index
                      ops and multiplied with one torch.bmm; the longest group is read back for each
                      product (forward: two per layer; backward: one per linear), only where the grouped
                      kernel cannot run

Routed experts are split over the expert-tensor-parallel ranks (--expert-tensor-parallel-size, TP by
default) as the dense MLP is over TP (fc1 by output rows, [gate; up] halves separately for SwiGLU; fc2 by
input columns); the outputs are partial sums over those ranks that the MoE layer reduces once. Without
--disable-bias-linear each routed expert has biases (gpt-oss's, Megatron's add_bias_linear): fc1's split as its
rows, fc2's whole on every ETP rank and added by the first, before the routing probability weighs the output. The shared
expert (--moe-shared-expert-intermediate-size, DeepSeek / Qwen2-MoE) is such an MLP, split over TP, that
every token runs; Qwen2-MoE scales its output by sigmoid(x w_gate) (--moe-shared-expert-gate).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.mlp import activation
from megatron_lite.model.moe.token_dispatcher import segment_ids
from megatron_lite.model.sharding import ShardSpec, new_parameter


def cuda_kernel_is_fused(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether torch's CUDA _grouped_mm multiplies `dtype` with its fused kernel on a GPU of compute
    `capability`: bf16 on 9.0 and newer. Elsewhere it falls back to reading the group offsets to the host and
    looping over the groups, which the padded bmm beats."""
    return dtype == torch.bfloat16 and capability >= (9, 0)


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch has a torch._grouped_mm kernel worth using for `dtype` on `device_type` (on CUDA the
    fused one; elsewhere any, tried once on a tiny input: CPU kernels came later than CUDA's)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cuda" and not cuda_kernel_is_fused(dtype, torch.cuda.get_device_capability()):
        return False
    try:
        x = torch.zeros(2, 8, device=device_type, dtype=dtype)
        torch._grouped_mm(x, torch.zeros(1, 8, 8, device=device_type, dtype=dtype),
                          offs=torch.tensor([2], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm runs rows `x` [N, in] times expert weights [out, in]: it exists for their device and
    dtype, there are rows (its backward rejects an empty input), and rows of in and of out elements are each a
    multiple of 16 bytes."""
    aligned = 16 // x.element_size()
    return (x.dtype == weight.dtype and x.shape[0] > 0 and x.shape[1] % aligned == 0
            and weight.shape[0] % aligned == 0 and grouped_mm_runs(x.device.type, x.dtype))


def _grouped_product(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, grouped_mm: bool) -> torch.Tensor:
    """[N, k] rows sorted by group times b [G, k, n] -> [N, n]: rows of group g times b[g] (the forward)."""
    if grouped_mm:
        return torch._grouped_mm(a, b, offs=counts.cumsum(0).to(torch.int32))
    (padded,), rows = _padded_by_group([a], counts, b.shape[0])
    return torch.bmm(padded, b)[rows]


def _grouped_backward(grad: torch.Tensor, x: torch.Tensor, stacked: torch.Tensor | None, counts: torch.Tensor,
                      groups: int, grouped_mm: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The gradients of rows `x` [N, in] sorted by group times each group's weight [out, in], from `grad`
    [N, out]: for the rows (None without `stacked`, the weights [G, out, in]) and for the weights [G, out, in].
    The two share the group offsets, or the padding of `grad` and its one host read."""
    if grouped_mm:  # the calls torch's own backward of the forward product makes
        offsets = counts.cumsum(0).to(torch.int32)
        grad_x = torch._grouped_mm(grad, stacked, offs=offsets) if stacked is not None else None
        return grad_x, torch._grouped_mm(x.t(), grad, offs=offsets).transpose(1, 2)
    (padded_grad, padded_x), rows = _padded_by_group([grad, x], counts, groups)
    grad_x = torch.bmm(padded_grad, stacked)[rows] if stacked is not None else None
    return grad_x, torch.bmm(padded_grad.transpose(1, 2), padded_x)


def _padded_by_group(tensors: list[torch.Tensor], counts: torch.Tensor,
                     groups: int) -> tuple[list[torch.Tensor], tuple]:
    """Each [N, d] of `tensors`, rows sorted by the same groups -> [G, longest, d] zero-padded, and the index
    of each row in them. The padding's length is one host read, shared by all of them."""
    rows = tensors[0].shape[0]
    index = segment_ids(counts, rows)
    longest = int(counts.max()) if rows else 0
    return [t.new_zeros(groups, longest, t.shape[1]).index_put(index, t) for t in tensors], index


class _ExpertsLinear(torch.autograd.Function):
    """Rows sorted by expert times each expert's own weight. The stacked [G, out, in] copy the kernels need is
    made in forward and again in backward, never kept between them: autograd would otherwise hold a copy of
    every local expert's weights per MoE layer for each micro-batch in flight."""

    @staticmethod
    def forward(ctx, x, counts, grouped_mm, *weights):
        ctx.grouped_mm = grouped_mm
        ctx.save_for_backward(x, counts, *weights)
        return _grouped_product(x, torch.stack(weights).transpose(1, 2), counts, grouped_mm)

    @staticmethod
    def backward(ctx, grad):
        x, counts, *weights = ctx.saved_tensors
        stacked = torch.stack(weights) if ctx.needs_input_grad[0] else None
        grad_x, grad_weights = _grouped_backward(grad.contiguous(), x, stacked, counts, len(weights),
                                                 ctx.grouped_mm)
        return grad_x, None, None, *grad_weights.unbind(0)


def experts_linear(x: torch.Tensor, weights: list[torch.Tensor], counts: torch.Tensor,
                   grouped_mm: bool | None = None) -> torch.Tensor:
    """[N, in] rows sorted by expert, each expert's weight [out, in], rows per expert [E] (on the device) ->
    [N, out], differentiable. `grouped_mm` chooses the kernel; None: torch._grouped_mm where it applies."""
    if grouped_mm is None:
        grouped_mm = grouped_mm_applies(x, weights[0])
    return _ExpertsLinear.apply(x, counts, grouped_mm, *weights)


class ExpertLinear(torch.nn.Module):
    """One weight of an expert, this TP rank's slice, and its bias where `bias` gives one; no communication (the
    MoE layer does it once)."""

    def __init__(self, spec: ShardSpec, tp_size: int, bias: ShardSpec | None = None):
        super().__init__()
        self.weight = new_parameter(spec, tp_size)
        self.bias = None if bias is None else new_parameter(bias, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ExpertMLP(torch.nn.Module):
    """h -> ffn -> h with GELU or a gated unit: [n, h] -> [n, h], a partial sum over TP. A routed expert
    (`expert=True`: gradients reduced over the expert-data-parallel group; biases without --disable-bias-linear)
    or the shared one (no biases)."""

    def __init__(self, config: ModelConfig, tp_size: int, ffn: int, *, expert: bool, width: int | None = None):
        """`width`: what the MLP reads and writes (the hidden size, or a routed expert's latent)."""
        super().__init__()
        self.config = config
        h, chunks = width or config.hidden_size, 2 if config.gated_linear_unit else 1
        biased = expert and not config.disable_bias_linear
        self.linear_fc1 = ExpertLinear(
            ShardSpec((chunks * ffn, h), tp_dim=0, tp_chunks=chunks, expert=expert), tp_size,
            ShardSpec((chunks * ffn,), tp_dim=0, tp_chunks=chunks, init="zeros", expert=True) if biased else None)
        self.linear_fc2 = ExpertLinear(ShardSpec((h, ffn), tp_dim=1, init="scaled_normal", expert=expert), tp_size,
                                       ShardSpec((h,), init="zeros", expert=True) if biased else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.config, self.linear_fc1(x)))


class GroupedExperts(torch.nn.ModuleList):
    """This rank's E / ep routed experts (ExpertMLPs, indexed as local experts, each split over `etp_size`
    ranks, this rank `etp_rank` of them), run as grouped GEMMs, at hidden-size or --moe-latent-size."""

    def __init__(self, config: ModelConfig, etp_size: int, num_local_experts: int, etp_rank: int = 0):
        super().__init__(ExpertMLP(config, etp_size, config.moe_ffn_hidden_size, expert=True,
                                   width=config.moe_latent_size) for _ in range(num_local_experts))
        self.config = config
        self.adds_output_bias = etp_rank == 0

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """[N, h] rows sorted by local expert, [E_local] rows per expert (on the device) -> [N, h]."""
        fc1 = [expert.linear_fc1.weight for expert in self]  # each [chunks ffn / tp, h]
        fc2 = [expert.linear_fc2.weight for expert in self]  # each [h, ffn / tp]
        hidden = experts_linear(x, fc1, tokens_per_expert)
        if self[0].linear_fc1.bias is None:
            return experts_linear(activation(self.config, hidden), fc2, tokens_per_expert)
        expert_of_row = segment_ids(tokens_per_expert, x.shape[0])[0]
        hidden = hidden + torch.stack([expert.linear_fc1.bias for expert in self])[expert_of_row]
        out = experts_linear(activation(self.config, hidden), fc2, tokens_per_expert)
        return out + self._output_bias(torch.stack([expert.linear_fc2.bias for expert in self])[expert_of_row])

    def _output_bias(self, bias_rows: torch.Tensor) -> torch.Tensor:
        """fc2's bias of each row [N, h] as this ETP rank adds it to its partial sum: whole on the first rank, zero
        on the others, so the reduced output holds it once. Every rank takes the bias's whole gradient (b - b is
        zero with b's gradient), as every ETP rank sees the same tokens and output gradients."""
        return bias_rows if self.adds_output_bias else bias_rows - bias_rows.detach()


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
