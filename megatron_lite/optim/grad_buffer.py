"""Contiguous gradient buffers cut into buckets, and the data-parallel wrapper that reduces them.

Megatron-style data parallelism: every parameter gets a `main_grad` view into one contiguous fp32
buffer (one per kind: dense parameters reduce over the dp x cp group, expert parameters over the
expert-data-parallel group). Parameters are laid out in reverse order of creation, which is roughly the
order their gradients become ready in backward, and the buffer is cut into buckets of about
`bucket_size` elements. A bucket is reduced with one collective: an all-reduce for plain data
parallelism, a reduce-scatter for the distributed optimizer (each rank keeps the shard it updates).
With `overlap_grad_reduce` a bucket's collective starts as soon as its last gradient has been
accumulated in the final micro-batch's backward pass; otherwise all start after backward.

Gradients are summed, not averaged: the training loop divides by the number of tokens in the global
batch afterwards, which makes the loss a mean over tokens whatever the split across ranks.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megatron_lite.parallel.state import ParallelState


class Bucket:
    """A contiguous slice of a gradient buffer whose parameters are reduced together."""

    def __init__(self, params: list[torch.nn.Parameter], grad_data: torch.Tensor, offset: int,
                 group, shard_grads: bool):
        self.params = params
        self.grad_data = grad_data  # view of the buffer, length divisible by the group size
        self.offset = offset
        self.group = group
        self.shard_grads = shard_grads
        self.pending = set(params)
        self.handle = None

    @property
    def group_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def shard(self) -> torch.Tensor:
        """This rank's 1/group_size slice of the bucket (what the distributed optimizer updates)."""
        size = self.grad_data.numel() // self.group_size
        rank = 0 if self.group is None else dist.get_rank(self.group)
        return self.grad_data[rank * size:(rank + 1) * size]

    def start_reduction(self) -> None:
        if self.group is None or self.handle is not None:
            return
        if self.shard_grads:
            self.handle = dist.reduce_scatter_single(self.shard(), self.grad_data, group=self.group, async_op=True)
        else:
            self.handle = dist.all_reduce(self.grad_data, group=self.group, async_op=True)

    def finish_reduction(self) -> None:
        self.start_reduction()
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        self.pending = set(self.params)


class GradBuffer:
    """One contiguous fp32 gradient buffer for parameters reduced over the same group."""

    def __init__(self, params: list[torch.nn.Parameter], group, bucket_size: int, shard_grads: bool):
        self.params = params
        self.group = group
        group_size = 1 if group is None else dist.get_world_size(group)
        device = params[0].device
        # Cut buckets in backward order; pad each bucket to a multiple of the group size so that a
        # reduce-scatter gives every rank an equal shard.
        spans, bucket_params, start, end = [], [], 0, 0
        for param in params:
            bucket_params.append(param)
            end += param.numel()
            if end - start >= bucket_size or param is params[-1]:
                padded_end = start + _round_up(end - start, group_size)
                spans.append((list(bucket_params), start, padded_end))
                bucket_params, start, end = [], padded_end, padded_end
        self.data = torch.zeros(end, dtype=torch.float32, device=device)
        self.buckets = []
        for bucket_params, start, stop in spans:
            offset = start
            for param in bucket_params:
                param.main_grad = self.data[offset:offset + param.numel()].view_as(param)
                param.grad_buffer_offset = offset
                offset += param.numel()
            self.buckets.append(Bucket(bucket_params, self.data[start:stop], start, group, shard_grads))
        self.bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class DistributedDataParallel(torch.nn.Module):
    """Wraps one model chunk: accumulates gradients into contiguous buffers and reduces them by bucket."""

    def __init__(self, module: torch.nn.Module, pstate: ParallelState, *, bucket_size: int = 40_000_000,
                 overlap_grad_reduce: bool = False, shard_grads: bool = False):
        super().__init__()
        self.module = module
        self.overlap_grad_reduce = overlap_grad_reduce
        self.is_last_microbatch = True
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # ~ backward order
        dense = [p for p in params if not p.spec.expert]
        expert = [p for p in params if p.spec.expert]
        self.buffers = []
        if dense:
            self.buffers.append(GradBuffer(dense, pstate.group("dp_cp"), bucket_size, shard_grads))
        if expert:
            self.buffers.append(GradBuffer(expert, pstate.group("expert_dp"), bucket_size, shard_grads))
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate) for p in params]

    def _accumulate(self, param: torch.nn.Parameter) -> None:
        """Move the fresh gradient into the buffer; start the bucket's reduction once it is complete."""
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.overlap_grad_reduce and self.is_last_microbatch:
            for buffer in self.buffers:
                bucket = buffer.bucket_of.get(param)
                if bucket is not None:
                    bucket.pending.discard(param)
                    if not bucket.pending:
                        bucket.start_reduction()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches before the last accumulate without starting any reduction."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.data.zero_()

    def finish_grad_sync(self) -> None:
        """Complete every bucket's reduction (starting those not yet started)."""
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                bucket.finish_reduction()

    def scale_gradients(self, factor: float) -> None:
        for buffer in self.buffers:
            buffer.data.mul_(factor)
