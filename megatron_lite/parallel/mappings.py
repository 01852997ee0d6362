"""Autograd-aware collectives, named after the region of the model they enter or leave.

Each function is a pair (forward op, backward op) that are adjoint to each other, so that gradients of
a tensor-parallel layer are exactly the gradients of the unsplit layer:

  copy_to_tensor_parallel_region           identity        | all-reduce
  reduce_from_tensor_parallel_region       all-reduce      | identity
  scatter_to_tensor_parallel_region        split last dim  | all-gather last dim
  gather_from_tensor_parallel_region       all-gather last | split last dim
  scatter_to_sequence_parallel_region      split dim 0     | all-gather dim 0
  gather_from_sequence_parallel_region     all-gather dim 0| reduce-scatter dim 0 (or split)
  reduce_scatter_to_sequence_parallel_region reduce-scatter | all-gather dim 0
  all_to_all                               all-to-all dim 0 | all-to-all back (uneven splits: MoE tokens)

A group of None means "no parallelism here" and every op is the identity. Under --torch-compile each op with a
group runs eagerly at a graph break: with torch 2.11, the compiled backward of a tensor-parallel layer whose
forward ends in the all-reduce gave wrong gradients (one step of a TP2 GPT: gradient norm 1.39, eager 1.70).
The module also holds the plain (non-autograd) collectives and point-to-point transfers of tensors the rest of
the package uses, so that no layer calls torch.distributed directly, a count of collectives (tests) can wrap
one place, and each records itself in parallel/progress.py for the hang report. The control plane alone calls
torch.distributed itself: object collectives and barriers of checkpoint agreement (checkpoint/) and of start-up
(parallel/lifecycle.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.parallel.progress import RECORD

# ---------------------------------------------------------------------------------------------------
# Plain collectives and point-to-point transfers (no autograd). Every tensor the package communicates goes
# through these functions.


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; a no-op without a group."""
    if group is not None:
        with RECORD.collective("all_reduce", group):
            dist.all_reduce(tensor, op=op, group=group)
    return tensor


def amax_over_groups(amax: torch.Tensor, groups: tuple) -> torch.Tensor:
    """In place: the max of `amax` over every rank of each group in `groups`, the ranks that hold the other parts
    of the tensor it was taken over; the FP8 scales' amax of the whole logical tensor (model/fp8.py)."""
    for group in groups:
        with RECORD.collective("all_reduce", group):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def start_all_reduce(tensor: torch.Tensor, group):
    """Launch an in-place sum over `group` and return its work (wait() before reading `tensor`)."""
    return RECORD.started("all_reduce", group, dist.all_reduce(tensor, group=group, async_op=True))


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """In place: every rank of `group` gets global rank `src`'s `tensor`; a no-op without a group."""
    if group is not None:
        with RECORD.collective("broadcast", group):
            dist.broadcast(tensor, src=src, group=group)
    return tensor


def isend(tensor: torch.Tensor, peer: int, group, tag: int = 0):
    """Start sending `tensor` to global rank `peer`; returns the work."""
    return RECORD.started(f"send to rank {peer}", group, dist.isend(tensor, dst=peer, group=group, tag=tag))


def irecv(tensor: torch.Tensor, peer: int, group, tag: int = 0):
    """Start receiving into `tensor` from global rank `peer`; returns the work."""
    return RECORD.started(f"receive from rank {peer}", group, dist.irecv(tensor, src=peer, group=group, tag=tag))


def all_gather_into_tensor(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Fill `output` [size * n, ...] with every rank's `tensor` [n, ...] in rank order; the work if async_op.

    torch 2.13 renamed this collective `all_gather_single` and deprecated the old name with a warning on
    every call; older torch (the 2.11 floor, that of GPU images) has only the old name. The lookup
    happens at each call, so that tests which wrap torch.distributed's functions see it.
    """
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    if async_op:
        return RECORD.started("all_gather", group, gather(output, tensor, group=group, async_op=True))
    with RECORD.collective("all_gather", group):
        return gather(output, tensor, group=group)


def reduce_scatter_tensor(output: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Sum `tensor` [size * n, ...] over ranks into `output` [n, ...], this rank's slice; the work if async_op.

    Named `reduce_scatter_single` from torch 2.13 on, with the same history as `all_gather_into_tensor`.
    """
    scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    if async_op:
        return RECORD.started("reduce_scatter", group, scatter(output, tensor, group=group, async_op=True))
    with RECORD.collective("reduce_scatter", group):
        return scatter(output, tensor, group=group)


def gather_to(tensor: torch.Tensor, gathered: list[torch.Tensor] | None, dst: int, group) -> None:
    """Global rank `dst` receives every rank's `tensor` (equal shapes) into `gathered`, in group-rank order;
    the other ranks pass None."""
    with RECORD.collective("gather", group):
        dist.gather(tensor, gathered, dst=dst, group=group)


def scatter_from(output: torch.Tensor, pieces: list[torch.Tensor] | None, src: int, group) -> None:
    """Every rank receives into `output` its piece of global rank `src`'s `pieces` (None elsewhere)."""
    with RECORD.collective("scatter", group):
        dist.scatter(output, pieces, src=src, group=group)


def all_gather_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0."""
    if group is None:
        return tensor
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    all_gather_into_tensor(out, tensor, group)
    return out


def reduce_scatter_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, each rank keeping its 1/size slice of dim 0."""
    if group is None:
        return tensor
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    out = torch.empty((tensor.shape[0] // size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    reduce_scatter_tensor(out, tensor, group)
    return out


def split_along_dim(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's equal slice of `tensor` along `dim`."""
    if group is None:
        return tensor
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return tensor.chunk(size, dim=dim)[rank].contiguous()


def all_to_all_single(tensor: torch.Tensor, group, output_splits: list[int] | None = None,
                      input_splits: list[int] | None = None) -> torch.Tensor:
    """Rows [sum(input_splits[:r]), +input_splits[r]) go to rank r; rank r's rows arrive in rank order.
    Without splits every rank sends (and receives) equal parts."""
    if group is None:
        return tensor
    tensor = tensor.contiguous()
    rows = tensor.shape[0] if output_splits is None else sum(output_splits)
    out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    with RECORD.collective("all_to_all", group):
        dist.all_to_all_single(out, tensor, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=group)
    return out


def all_gather_along_dim(tensor: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's tensor along `dim`."""
    if group is None:
        return tensor
    gathered = all_gather_dim0(tensor.movedim(dim, 0), group)
    return gathered.movedim(0, dim).contiguous()


# ---------------------------------------------------------------------------------------------------
# Autograd functions: entering and leaving the tensor-parallel and sequence-parallel regions.


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # A copy: autograd may hand the same gradient tensor to a sibling branch (x + y passes one
        # tensor to both), which an in-place all-reduce would corrupt.
        return all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.group, -1), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along_dim(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, ctx.group, -1), None


class _ScatterDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, group, 0)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_feeds_tensor_parallel):
        ctx.group = group
        ctx.reduce_grad = output_feeds_tensor_parallel
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_along_dim(grad, ctx.group, 0), None, None


class _ReduceScatterDim0(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        return all_to_all_single(x, group, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_single(grad, ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


@torch.compiler.disable
def _apply_eagerly(function: type[torch.autograd.Function], *args):
    """`function.apply(*args)`, outside any torch.compile graph (see the module's docstring)."""
    return function.apply(*args)


def copy_to_tensor_parallel_region(x, group):
    """Enter a TP region with a replicated input: identity forward, all-reduce of the gradient."""
    return x if group is None else _apply_eagerly(_CopyToRegion, x, group)


def reduce_from_tensor_parallel_region(x, group):
    """Leave a TP region by summing partial results: all-reduce forward, identity backward."""
    return x if group is None else _apply_eagerly(_ReduceFromRegion, x, group)


def scatter_to_tensor_parallel_region(x, group):
    """Keep this rank's slice of the last dimension."""
    return x if group is None else _apply_eagerly(_ScatterLastDim, x, group)


def gather_from_tensor_parallel_region(x, group):
    """Concatenate the ranks' slices of the last dimension."""
    return x if group is None else _apply_eagerly(_GatherLastDim, x, group)


def scatter_to_sequence_parallel_region(x, group):
    """[s, b, h] -> [s/tp, b, h]: keep this rank's slice of the sequence."""
    return x if group is None else _apply_eagerly(_ScatterDim0, x, group)


def gather_from_sequence_parallel_region(x, group, output_feeds_tensor_parallel=True):
    """[s/tp, b, h] -> [s, b, h]. The gradient is reduce-scattered when the output feeds a TP layer
    (each rank's gradient is a partial sum), else just split."""
    return x if group is None else _apply_eagerly(_GatherDim0, x, group, output_feeds_tensor_parallel)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """[s, b, h] partial sums -> [s/tp, b, h] full sums: the SP replacement of the TP all-reduce."""
    return x if group is None else _apply_eagerly(_ReduceScatterDim0, x, group)


def all_to_all(x, group, output_splits: list[int], input_splits: list[int]):
    """Exchange rows with every rank of `group` (uneven splits); the gradient travels the reverse way."""
    return x if group is None else _apply_eagerly(_AllToAll, x, group, output_splits, input_splits)
