"""Parameter and gradient buffers cut into buckets: the storage and collectives of data parallelism.

A `Bucket` is a contiguous range of a buffer holding several parameters, padded to a multiple of the
data-parallel group size, reduced with one collective (all-reduce, or reduce-scatter so that each rank keeps
a 1/d shard) and, when parameters are sharded, gathered with one all-gather. A `GradBuffer` holds the buckets
of the parameters of one dtype reduced over one group. What each ZeRO stage keeps is described in
zero_stage.py; data_parallel.py's DistributedDataParallel drives these buckets from autograd hooks.

With several distributed-optimizer instances the group is one instance's ranks (d is its size) and the
same shard lives on one rank of every instance: after the last micro-batch each rank all-reduces its
reduced shard with those ranks (the inter-instance group), once per step even where ZeRO-2/3
reduce-scatter every micro-batch, since a sum of all-reduces is the all-reduce of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.optim.zero_stage import ZeroStage
from megatron_lite.parallel import mappings


@dataclass
class OwnedRange:
    """Elements [start, stop) of `param` (flattened) that this rank reduces and steps.

    `grad` holds their reduced fp32 gradient, `model_data` the persistent parameter storage the model
    reads them from (parameter dtype); both are 1-D views."""

    param: torch.nn.Parameter
    start: int
    stop: int
    grad: torch.Tensor
    model_data: torch.Tensor


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class Bucket:
    """Parameters whose gradients are reduced together and, when sharded, whose values are gathered together.

    The bucket spans `numel` elements (a multiple of the group size): each parameter at `offsets[param]`,
    padding at the end. This rank owns elements [shard_start, shard_start + shard_size).
    """

    def __init__(self, params: list[torch.nn.Parameter], group, stage: ZeroStage):
        self.params = params
        self.group = group
        self.stage = stage
        size = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        self.offsets, numel = {}, 0
        for param in params:
            self.offsets[param] = numel
            numel += param.numel()
        self.numel = _round_up(numel, size)
        self.shard_size = self.numel // size
        self.shard_start = rank * self.shard_size
        self.grad_data: torch.Tensor | None = None  # [numel] fp32: this rank's gradient sums
        self.grad_shard: torch.Tensor | None = None  # [shard_size] fp32: reduced owned gradients (ZeRO-2/3)
        self.param_data: torch.Tensor | None = None  # [numel] parameter storage (ZeRO-1/2/3)
        self.param_shard: torch.Tensor | None = None  # [shard_size] persistent owned parameters (ZeRO-3)
        self.pending = set(params)  # parameters whose gradient has not arrived in this backward
        self.grad_handle = None
        self.scattered: torch.Tensor | None = None  # reduce-scatter output in flight (ZeRO-2/3)
        self.param_handle = None
        self.gathered = True

    def _owned(self, param) -> tuple[int, int]:
        """The flat range of `param` inside this rank's shard (empty when they do not meet)."""
        offset, numel = self.offsets[param], param.numel()
        if not self.stage.shards_optimizer_state:
            return 0, numel
        start = min(max(self.shard_start - offset, 0), numel)
        stop = max(min(self.shard_start + self.shard_size - offset, numel), start)
        return start, stop

    def owned_ranges(self) -> list[OwnedRange]:
        ranges = []
        for param in self.params:
            start, stop = self._owned(param)
            if stop > start:
                ranges.append(OwnedRange(param, start, stop, self.owned_grad(param), self._owned_model_data(param)))
        return ranges

    def owned_grad(self, param) -> torch.Tensor:
        """1-D view of the reduced gradient of this rank's elements of `param`."""
        start, stop = self._owned(param)
        if self.stage.shards_grads:
            begin = self.offsets[param] + start - self.shard_start
            return self.grad_shard[begin:begin + stop - start]
        begin = self.offsets[param]
        return self.grad_data[begin + start:begin + stop]

    def _owned_model_data(self, param) -> torch.Tensor:
        start, stop = self._owned(param)
        if self.stage.shards_params:
            begin = self.offsets[param] + start - self.shard_start
            return self.param_shard[begin:begin + stop - start]
        if self.stage.shards_optimizer_state:
            begin = self.offsets[param]
            return self.param_data[begin + start:begin + stop]
        return param.detach().view(-1)

    # -- gradients ------------------------------------------------------------------------------------
    def attach_grads(self, data: torch.Tensor) -> None:
        """Make `data` ([numel] fp32) this bucket's gradient buffer and point every main_grad into it."""
        self.grad_data = data
        for param in self.params:
            offset = self.offsets[param]
            param.main_grad = data[offset:offset + param.numel()].view_as(param)

    def start_grad_reduction(self) -> None:
        """Launch this bucket's collective (asynchronously); a no-op while one is in flight."""
        if self.grad_handle is not None or self.scattered is not None:
            return
        if not self.stage.shards_grads:
            if self.group is None:
                return
            if not self.stage.shards_optimizer_state:
                self.grad_handle = mappings.start_all_reduce(self.grad_data, self.group)
            else:
                shard = self.grad_data[self.shard_start:self.shard_start + self.shard_size]
                self.grad_handle = mappings.reduce_scatter_tensor(shard, self.grad_data, self.group, async_op=True)
            return
        if self.grad_data is None:  # no gradient reached this bucket in this backward on this rank
            self.attach_grads(torch.zeros(self.numel, dtype=torch.float32, device=self.grad_shard.device))
        if self.group is None:
            self.scattered = self.grad_data
        else:
            self.scattered = torch.empty_like(self.grad_shard)
            self.grad_handle = mappings.reduce_scatter_tensor(self.scattered, self.grad_data, self.group,
                                                              async_op=True)

    def finish_grad_reduction(self) -> None:
        """Wait for the collective in flight, if any; ZeRO-2/3 then add the result into the shard and drop
        the temporary buffer."""
        if self.grad_handle is not None:
            self.grad_handle.wait()
            self.grad_handle = None
        if self.scattered is not None:
            self.grad_shard.add_(self.scattered)
            self.scattered, self.grad_data = None, None
            for param in self.params:
                param.main_grad = None
        self.pending = set(self.params)

    # -- parameters -----------------------------------------------------------------------------------
    def attach_params(self) -> None:
        """Move the parameters into one [numel] buffer (ZeRO-1/2/3); ZeRO-3 keeps only its shard."""
        param = self.params[0]
        self.param_data = torch.zeros(self.numel, dtype=param.dtype, device=param.device)
        for param in self.params:
            offset = self.offsets[param]
            self.param_data[offset:offset + param.numel()].copy_(param.detach().view(-1))
            param.data = self.param_data[offset:offset + param.numel()].view_as(param)
        if self.stage.shards_params:
            self.param_shard = self.param_data[self.shard_start:self.shard_start + self.shard_size].clone()
            self.free_params()

    def start_param_gather(self) -> None:
        """All-gather the parameters from every rank's shard (asynchronously; see finish_param_gather)."""
        if self.param_handle is not None or (self.gathered and self.stage.shards_params):
            return
        if self.stage.shards_params:  # storage back, then fill it
            self.param_data.untyped_storage().resize_(self.numel * self.param_data.element_size())
            self.gathered = True
            if self.group is None:
                self.param_data.copy_(self.param_shard)
                return
            source = self.param_shard
        else:
            source = self.param_data[self.shard_start:self.shard_start + self.shard_size]
        if self.group is not None:
            self.param_handle = mappings.all_gather_into_tensor(self.param_data, source, self.group, async_op=True)

    def finish_param_gather(self) -> None:
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None

    def free_params(self) -> None:
        """ZeRO-3: release the gathered parameters (their shard stays in param_shard)."""
        self.finish_param_gather()
        self.param_data.untyped_storage().resize_(0)
        self.gathered = False


def cut_buckets(params: list[torch.nn.Parameter], bucket_size: int, unit_of: dict,
                 isolated: set) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters grouped into buckets of about `bucket_size` elements; a bucket never spans
    two ZeRO-3 units, and each `isolated` parameter gets a bucket of its own."""
    buckets, current, size = [], [], 0
    for param in params:
        if current and (size >= bucket_size or param in isolated or current[-1] in isolated
                        or unit_of.get(param) is not unit_of.get(current[-1])):
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    if current:
        buckets.append(current)
    return buckets


class GradBuffer:
    """The buckets of parameters of one dtype reduced over one group; `data` is their persistent fp32
    gradient storage: the whole buckets (no_shard, optim) or this rank's shards (optim_grads(_params)).
    `inter_instance_group` holds the ranks with the same shards in the other distributed-optimizer instances."""

    def __init__(self, bucket_params: list[list[torch.nn.Parameter]], group, stage: ZeroStage,
                 inter_instance_group=None):
        self.stage = stage
        self.inter_instance_group = inter_instance_group
        self.buckets = [Bucket(params, group, stage) for params in bucket_params]
        device = bucket_params[0][0].device
        whole = not stage.shards_grads
        sizes = [b.numel if whole else b.shard_size for b in self.buckets]
        self.data = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        start = 0
        for bucket, size in zip(self.buckets, sizes):
            if whole:
                bucket.attach_grads(self.data[start:start + size])
            else:
                bucket.grad_shard = self.data[start:start + size]
            if stage.shards_optimizer_state:
                bucket.attach_params()
            start += size

    def reduced_shards(self) -> list[torch.Tensor]:
        """The gradients this rank holds reduced once the buckets' reductions have finished: ZeRO-2/3 keep only
        the shards, all of `data`; ZeRO-1 each bucket's shard of its whole gradients; no_shard all of `data`."""
        if self.stage.shards_grads or not self.stage.shards_optimizer_state:
            return [self.data]
        return [b.grad_data[b.shard_start:b.shard_start + b.shard_size] for b in self.buckets]

    def all_reduce_across_instances(self) -> None:
        """Sum this rank's reduced shards with the other instances' copies: one collective per shard."""
        group = self.inter_instance_group
        if group is None:
            return
        for handle in [mappings.start_all_reduce(shard, group) for shard in self.reduced_shards()]:
            handle.wait()
