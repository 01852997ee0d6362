"""FP8 GEMMs of the tensor-parallel linears (--fp8-format, --fp8-recipe): current scaling through torch._scaled_mm.

A linear Y = X W^T runs three GEMMs, each here on FP8 operands with fp32 accumulation:

  forward   Y  [m, n] = X  [m, k] . W^T [k, n]
  dgrad     dX [m, k] = dY [m, n] . W   [n, k]
  wgrad     dW [n, k] = dY^T [n, m] . X [m, k]

(m tokens, k input and n output features). Every operand is quantized just before its GEMM from its current
values (Transformer Engine's current scaling, torchao's dynamic scaling): scale = fp8_max / amax / 2^margin, so
that the largest magnitude lands `margin` binades below the format's largest finite value; an all-zero operand
gets scale 1. The GEMM (torch._scaled_mm on CUDA; elsewhere an fp32 matmul of the FP8 values, which rounds
only where _scaled_mm's fp32 accumulation does) multiplies the FP8 product by the inverse scales. `tensorwise`
takes one amax per operand; `rowwise` one per row of the left operand and per column of the right one, that is
per slice along the contracted dimension, so each GEMM quantizes its operands along its own contraction (X per
token in forward, per feature in wgrad). The e4m3 format quantizes everything to e4m3; `hybrid` the gradient dY
to e5m2 (more range, less precision), the rest to e4m3. The gradient is always the left operand: torch's rowwise
CUDA kernel takes e5m2 only there.

Scales do not depend on the layout. An amax is the max over the whole logical operand (or its whole rows), so
where the tensor-parallel group splits the reduced extent (the input features of a row-parallel linear, the
output features of a column-parallel one) or the context-parallel group splits the tokens, the local amax is
maxed over that group (mappings.amax_over_groups) before quantizing: every layout quantizes each value exactly
as one process does. Sequence parallelism needs nothing more: the linears see the gathered sequence.

Tensorwise saves X in FP8 for wgrad (the same values forward multiplied) and requantizes W in backward (the same
values again), so no per-micro-batch copy of a weight is kept; rowwise quantizes X and W along the other
dimension in backward and so saves them in the activation dtype, as a plain linear does. GEMMs write the
activation dtype, except rowwise ones on CUDA in fp32: torch's rowwise CUDA kernel writes only bf16, cast to fp32
after (elsewhere fp32 outputs keep the partial sums of TP and CP exact to fp32 rounding, which the layout tests
check). Weights, their gradients and checkpoints stay as they are: FP8 exists only inside a GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.parallel import mappings

FORMATS = {"e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn), "hybrid": (torch.float8_e4m3fn, torch.float8_e5m2)}


@dataclass(frozen=True)
class FP8Recipe:
    """How a layer's linears quantize: --fp8-format, --fp8-recipe and --fp8-margin."""

    format: str
    recipe: str
    margin: int = 0

    @property
    def forward_dtype(self) -> torch.dtype:
        """The FP8 type of activations and weights."""
        return FORMATS[self.format][0]

    @property
    def gradient_dtype(self) -> torch.dtype:
        """The FP8 type of the output gradient dY."""
        return FORMATS[self.format][1]

    @classmethod
    def for_layer(cls, config, layer_number: int) -> FP8Recipe | None:
        """The recipe of global layer `layer_number` (0-based), or None where it computes in the activation dtype:
        FP8 off, or with --first-last-layers-bf16 one of the first --num-layers-at-start-in-bf16 or the last
        --num-layers-at-end-in-bf16 layers of the whole model (Megatron's is_first_last_bf16_layer)."""
        if config.fp8_format is None:
            return None
        if config.first_last_layers_bf16 and (layer_number < config.num_layers_at_start_in_bf16 or
                                              layer_number >= config.num_layers - config.num_layers_at_end_in_bf16):
            return None
        return cls(config.fp8_format, config.fp8_recipe, config.fp8_margin)


@dataclass(frozen=True)
class GemmSplits:
    """The process groups that split each dimension of a linear's GEMMs on this rank (empty: held whole):
    tokens m, input features k, output features n."""

    m: tuple = ()
    k: tuple = ()
    n: tuple = ()


def _groups(*groups) -> tuple:
    return tuple(group for group in groups if group is not None)


def column_parallel_splits(pstate) -> GemmSplits:
    """A column-parallel linear: output features split over TP, tokens over CP."""
    return GemmSplits(m=_groups(pstate.group("cp")), n=_groups(pstate.group("tp")))


def row_parallel_splits(pstate) -> GemmSplits:
    """A row-parallel linear: input features split over TP, tokens over CP."""
    return GemmSplits(m=_groups(pstate.group("cp")), k=_groups(pstate.group("tp")))


def quantize(x: torch.Tensor, dtype: torch.dtype, margin: int, dim: int | None, groups: tuple):
    """x [r, c] -> (FP8 x, inverse scale): one scale for the whole tensor (dim None), or one per slice along `dim`
    (dim 1: a [r, 1] column of per-row scales; dim 0: a [1, c] row of per-column scales). The amax is maxed over
    `groups`, the ranks that hold the rest of the reduced extent."""
    magnitude = x.detach().abs()
    amax = (magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)).float()
    amax = mappings.amax_over_groups(amax, groups)
    fp8_max = torch.finfo(dtype).max
    # fp8_max / amax correctly rounded (a scalar over a tensor is the tensor's reciprocal times the scalar in torch)
    scale = torch.where(amax > 0, torch.full_like(amax, fp8_max).div_(amax).div_(2.0**margin), torch.ones_like(amax))
    quantized = (x.detach().float() * scale).clamp_(-fp8_max, fp8_max).to(dtype)
    return quantized, scale.reciprocal()


def _quantize_left(a, dtype, recipe: FP8Recipe, contracted: tuple, rows: tuple):
    """The left operand a [M, K] of a GEMM, row-major as _scaled_mm takes it."""
    if recipe.recipe == "tensorwise":
        return quantize(a.contiguous(), dtype, recipe.margin, None, contracted + rows)
    return quantize(a.contiguous(), dtype, recipe.margin, 1, contracted)


def _quantize_right(b, dtype, recipe: FP8Recipe, contracted: tuple, columns: tuple):
    """The right operand b [K, N], column-major as _scaled_mm takes it (quantized as b^T [N, K], row-major)."""
    if recipe.recipe == "tensorwise":
        quantized, inverse = quantize(b.t().contiguous(), dtype, recipe.margin, None, contracted + columns)
        return quantized.t(), inverse
    quantized, inverse = quantize(b.t().contiguous(), dtype, recipe.margin, 1, contracted)
    return quantized.t(), inverse.t()


def scaled_gemm(a_fp8, a_inverse, b_fp8, b_inverse, recipe: FP8Recipe, out_dtype: torch.dtype) -> torch.Tensor:
    """(a_fp8 . a_inverse) @ (b_fp8 . b_inverse), accumulated in fp32, in `out_dtype` (rowwise on CUDA: through
    bf16). torch._scaled_mm on CUDA; elsewhere scaled_gemm_exact."""
    if not a_fp8.is_cuda:
        return scaled_gemm_exact(a_fp8, a_inverse, b_fp8, b_inverse, out_dtype)
    gemm_dtype = torch.bfloat16 if recipe.recipe == "rowwise" else out_dtype
    out = torch._scaled_mm(a_fp8, b_fp8, scale_a=a_inverse, scale_b=b_inverse, out_dtype=gemm_dtype)
    return out.to(out_dtype)


def scaled_gemm_exact(a_fp8, a_inverse, b_fp8, b_inverse, out_dtype: torch.dtype) -> torch.Tensor:
    """What _scaled_mm computes, by an fp32 matmul: every FP8 value is exact in fp32, and so is the product of
    two (at most 4 x 4 significant bits), so the only rounding is the fp32 accumulation, as in _scaled_mm; the
    inverse scales (a scalar each, or a [M, 1] column and a [1, N] row) then multiply the fp32 sums, and the
    result rounds once to `out_dtype`. A CPU's _scaled_mm is a reference kernel whose speed depends on the host's
    oneDNN (about 1 s for a 1024x128x256 product on a Xeon without an FP8 kernel, against a millisecond here)."""
    sums = a_fp8.float() @ b_fp8.float()  # [M, N]
    return (sums * a_inverse * b_inverse).to(out_dtype)


class _FP8Linear(torch.autograd.Function):
    """Y = X W^T with the three GEMMs in FP8 (the module's docstring); x [m, k], weight [n, k]."""

    @staticmethod
    def forward(ctx, x, weight, recipe: FP8Recipe, splits: GemmSplits):
        x_fp8, x_inverse = _quantize_left(x, recipe.forward_dtype, recipe, splits.k, splits.m)
        w_fp8, w_inverse = _quantize_right(weight.t(), recipe.forward_dtype, recipe, splits.k, splits.n)
        y = scaled_gemm(x_fp8, x_inverse, w_fp8, w_inverse, recipe, x.dtype)  # [m, n]
        ctx.recipe, ctx.splits, ctx.x_dtype = recipe, splits, x.dtype
        if recipe.recipe == "tensorwise":  # X^T's quantization is X's: keep it for wgrad
            ctx.save_for_backward(x_fp8, x_inverse, weight)
        else:
            ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        recipe, splits = ctx.recipe, ctx.splits
        grad_y = grad_y.contiguous()
        g_fp8, g_inverse = _quantize_left(grad_y, recipe.gradient_dtype, recipe, splits.n, splits.m)
        if recipe.recipe == "tensorwise":
            x_fp8, x_inverse, weight = ctx.saved_tensors
            w_fp8, w_inverse = _quantize_right(weight, recipe.forward_dtype, recipe, splits.n, splits.k)
            grad_x = scaled_gemm(g_fp8, g_inverse, w_fp8, w_inverse, recipe, ctx.x_dtype)  # [m, k]
            g_t_fp8 = g_fp8.t().contiguous()  # the same scale serves dY^T
            grad_w = scaled_gemm(g_t_fp8, g_inverse, x_fp8.t().contiguous().t(), x_inverse, recipe, weight.dtype)
            return grad_x, grad_w, None, None
        x, weight = ctx.saved_tensors
        w_fp8, w_inverse = _quantize_right(weight, recipe.forward_dtype, recipe, splits.n, splits.k)
        grad_x = scaled_gemm(g_fp8, g_inverse, w_fp8, w_inverse, recipe, ctx.x_dtype)  # [m, k]
        g_t_fp8, g_t_inverse = _quantize_left(grad_y.t(), recipe.gradient_dtype, recipe, splits.m, splits.n)
        x_fp8, x_inverse = _quantize_right(x, recipe.forward_dtype, recipe, splits.m, splits.k)
        grad_w = scaled_gemm(g_t_fp8, g_t_inverse, x_fp8, x_inverse, recipe, weight.dtype)  # [n, k]
        return grad_x, grad_w, None, None


@torch.compiler.disable  # the amax reductions are collectives: eager under --torch-compile, as mappings' are
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: FP8Recipe,
               splits: GemmSplits) -> torch.Tensor:
    """F.linear(x, weight, bias) with FP8 GEMMs: x [..., k], weight [n, k] -> [..., n]; the bias is added in the
    activation dtype."""
    y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), weight, recipe, splits).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
