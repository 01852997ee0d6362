"""DistributedDataParallel: reduces gradients by bucket and keeps parameters as the ZeRO stage says.

Megatron-style data parallelism over the buckets of param_and_grad_buffer.py. Every parameter gets a
`main_grad` view into a contiguous fp32 gradient buffer, one per kind of parameter (dense parameters reduce
over the dp x cp group, expert parameters over the expert-data-parallel group) and dtype. Parameters are
laid out in reverse order of creation, which is roughly the order their gradients become ready in
backward, and cut into buckets of about `bucket_size` elements, each padded to a multiple of the group
size so that a reduce-scatter gives every rank an equal, contiguous shard. A bucket is reduced with one
collective. Gradients are summed, not averaged: the training loop divides by the number of tokens in the
global batch afterwards.

`data_parallel_sharding_strategy` (the ZeRO stage, zero_stage.py) decides what a rank keeps between steps.
With --num-distributed-optimizer-instances N a sharded strategy shards within each instance (the
intra_dp_cp and intra_expert_dp groups of parallel/state.py): reduce-scatters and all-gathers stay inside
it, and finish_grad_sync all-reduces each rank's gradient shards across the instances (inter_dist_opt).
ZeRO-2 reduce-scatters in every micro-batch (DeepSpeed's trade: more communication for 1/d of the gradient
memory).

ZeRO-3 is our own, not PyTorch's FSDP2 `fully_shard`: FSDP2 turns parameters into DTensors and reduces
gradients into `.grad` itself, which composes neither with the `main_grad` buffers nor with the ShardSpecs
of the tensor-parallel layers and the global-norm code. The unit of gathering is one transformer layer
(the rest of a chunk, embeddings, final norm and output layer, is one more unit). Buckets never span
units. A unit is all-gathered by a forward pre-hook into freshly allocated storage and freed by a forward
hook (the storage is resized to zero, as in FSDP1: parameters and the tensors autograd saved keep pointing
at it), which also hooks the unit's output so that its gradient re-gathers the unit before the unit's
backward runs; once all the unit's gradients are accumulated its buckets are reduce-scattered and the unit
freed again. Inside backward (activation recomputation) forward hooks gather but do not free.
`--overlap-param-gather` prefetches the next unit (the previous one in backward); for ZeRO-1/2 it makes
the post-step all-gathers asynchronous, each module waiting for its own buckets in a forward pre-hook.
Expert buckets are never reduced from a gradient hook: whether an expert's gradient arrives may depend on
the routing, and the ranks of a group must issue collectives in one order, so they go after backward.

A rank's shard of a bucket is a flat range of elements, so a parameter's part of it is a flat range of
the parameter's elements (`OwnedRange`); the distributed optimizer steps exactly those, and `FlatShard`
is how such a range is described to checkpoints.
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial

import torch

from megatron_lite.model.contract import ModelChunk, check_model_chunk
from megatron_lite.model.sharding import FlatShard
from megatron_lite.optim.param_and_grad_buffer import (
    Bucket,
    GradBuffer,
    OwnedRange,
    cut_buckets,
    storage_bytes,
)
from megatron_lite.optim.zero_stage import ZeroStage
from megatron_lite.parallel.state import ParallelState


class _Unit:
    """ZeRO-3: the buckets of one module (a transformer layer, or the rest of a chunk), gathered together."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.buckets: list[Bucket] = []
        self.ready: set[int] = set()  # buckets whose gradients are complete in this backward

    def gather(self, wait: bool = True) -> None:
        for bucket in self.buckets:
            bucket.start_param_gather()
        if wait:
            for bucket in self.buckets:
                bucket.finish_param_gather()

    def free(self) -> None:
        for bucket in self.buckets:
            if bucket.gathered:
                bucket.free_params()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _calls_while_alive(method):
    """`method` behind a weak reference to its object. A parameter's gradient hook is held by autograd in
    C++, where the garbage collector cannot see it: a hook bound to the wrapper would make the wrapper, the
    model and its process groups immortal once the model is dropped."""
    target = weakref.WeakMethod(method)

    def call(*args):
        bound = target()
        if bound is not None:
            bound(*args)
    return call


class DistributedDataParallel(torch.nn.Module):
    """Wraps one model chunk: accumulates gradients into contiguous buffers, reduces them by bucket and,
    when sharded, keeps and gathers the parameters as the ZeRO stage says."""

    def __init__(self, module: ModelChunk, pstate: ParallelState, *, bucket_size: int = 40_000_000,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 data_parallel_sharding_strategy: str = "no_shard", param_dtype: torch.dtype | None = None):
        super().__init__()
        check_model_chunk(module)
        self.module = module
        self.stage = ZeroStage(data_parallel_sharding_strategy)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.is_last_microbatch = True
        self._end_of_backward_queued = False
        self._reduced: set[int] = set()  # ZeRO-2/3: buckets reduced in the current backward
        if param_dtype is not None:  # bf16/fp16 training: low-precision weights, fp32 gradients and masters
            for param in module.parameters():
                param.data = param.data.to(param_dtype)
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # ~ backward order
        self.units = self._build_units() if self.stage.shards_params else []
        unit_of = {p: unit for unit in self.units for p in unit.module.parameters()}
        isolated = set(module.shared_embedding_parameters())  # same shard on the first and the last stage
        kinds = sorted({(p.spec.expert, p.dtype) for p in params}, key=str)
        self.buffers = []
        sharded = self.stage.shards_optimizer_state  # sharded within a distributed-optimizer instance
        for expert, dtype in kinds:
            members = [p for p in params if (p.spec.expert, p.dtype) == (expert, dtype)]
            kind = "expert_dp" if expert else "dp_cp"
            group = pstate.group("intra_" + kind if sharded else kind)
            self.buffers.append(GradBuffer(cut_buckets(members, bucket_size, unit_of, isolated), group, self.stage,
                                           pstate.group("inter_dist_opt") if sharded else None))
        self.buckets = [bucket for buffer in self.buffers for bucket in buffer.buckets]
        self.bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        accumulate = _calls_while_alive(self._accumulate)
        self._hooks = [p.register_post_accumulate_grad_hook(accumulate) for p in params]
        if self.units:
            self._unit_of_bucket = {}
            for bucket in self.buckets:
                unit = unit_of.get(bucket.params[0])
                unit.buckets.append(bucket)
                self._unit_of_bucket[bucket] = unit
            for index, unit in enumerate(self.units):
                self._hooks.append(unit.module.register_forward_pre_hook(partial(self._before_forward, index)))
                self._hooks.append(unit.module.register_forward_hook(partial(self._after_forward, index)))
        elif overlap_param_gather and self.stage.shards_optimizer_state:
            for submodule in module.modules():
                buckets = list(dict.fromkeys(self.bucket_of[p] for p in submodule.parameters(recurse=False)
                                             if p in self.bucket_of))
                if buckets:
                    self._hooks.append(submodule.register_forward_pre_hook(partial(self._wait_for_params, buckets)))

    def _build_units(self) -> list[_Unit]:
        """The chunk itself (everything outside its sharding units), then its sharding units in forward order."""
        return [_Unit(self.module)] + [_Unit(m) for m in self.module.sharding_units()]

    # -- backward -------------------------------------------------------------------------------------
    def _accumulate(self, param: torch.nn.Parameter) -> None:
        """Move the fresh gradient into the buffer; reduce a bucket as soon as it is complete when the
        strategy (ZeRO-2/3) or --overlap-grad-reduce (last micro-batch) asks for it.

        Expert buckets are reduced only after backward, in bucket order: whether an expert's gradient
        arrives can depend on the routing, and every rank must issue the collectives in the same order."""
        bucket = self.bucket_of[param]
        if bucket.grad_data is None:  # ZeRO-2/3: a fresh temporary buffer for this backward
            bucket.attach_grads(torch.zeros(bucket.numel, dtype=torch.float32, device=param.device))
        param.main_grad.add_(param.grad)
        param.grad = None
        if self.stage.shards_grads:
            self._queue_end_of_backward()
            bucket.pending.discard(param)
            if not bucket.pending:
                self._bucket_complete(bucket)
        elif self.overlap_grad_reduce and self.is_last_microbatch and not param.spec.expert:
            bucket.pending.discard(param)
            if not bucket.pending:
                bucket.start_grad_reduction()

    def _bucket_complete(self, bucket: Bucket) -> None:
        """ZeRO-2/3: reduce-scatter a complete bucket now (expert buckets wait for the end of backward); under
        ZeRO-3 free a unit whose gradients are all complete."""
        if not bucket.params[0].spec.expert:
            bucket.start_grad_reduction()
            self._reduced.add(id(bucket))
            if not self.overlap_grad_reduce:
                bucket.finish_grad_reduction()
        if self.units:
            unit = self._unit_of_bucket[bucket]
            unit.ready.add(id(bucket))
            if len(unit.ready) == len(unit.buckets):
                unit.free()

    def _queue_end_of_backward(self) -> None:
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """ZeRO-2/3, after each backward: reduce the buckets not yet reduced (some of their parameters got
        no gradient), wait for all reductions, free every unit still gathered."""
        self._end_of_backward_queued = False
        for bucket in self.buckets:
            if id(bucket) not in self._reduced:
                bucket.start_grad_reduction()
        for bucket in self.buckets:
            bucket.finish_grad_reduction()
        self._reduced.clear()
        for unit in self.units:
            unit.ready.clear()
            unit.free()

    # -- ZeRO-3 forward -------------------------------------------------------------------------------
    def _before_forward(self, index: int, module, args) -> None:
        self.units[index].gather()
        if self.overlap_param_gather and not _in_backward() and index + 1 < len(self.units):
            self.units[index + 1].gather(wait=False)

    def _after_forward(self, index: int, module, args, output):
        if _in_backward():  # recomputation: the unit is freed once its gradients are complete
            return output
        if torch.is_grad_enabled():
            for tensor in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._before_backward, index))
        self.units[index].free()
        return output

    def _before_backward(self, index: int, grad: torch.Tensor) -> None:
        self._queue_end_of_backward()
        self.units[index].gather()
        if self.overlap_param_gather and index > 1:  # the previous layer's backward comes next
            self.units[index - 1].gather(wait=False)

    def _wait_for_params(self, buckets: list[Bucket], module, args) -> None:
        for bucket in buckets:
            bucket.finish_param_gather()

    # -- the training loop's interface ----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def pstate(self) -> ParallelState:
        return self.module.pstate

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.module.set_input_tensor(tensor)

    def rng_trackers(self) -> list:
        return self.module.rng_trackers()

    def named_global_buffers(self):
        return self.module.named_global_buffers()

    def training_hooks(self):
        return self.module.training_hooks()

    @contextlib.contextmanager
    def no_sync(self):
        """Micro-batches before the last accumulate without starting any reduction (no_shard, optim)."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.data.zero_()

    def finish_grad_sync(self) -> None:
        """After the last micro-batch: complete every bucket's reduction (no_shard, optim; ZeRO-2/3 reduced
        each backward's gradients at its end), then sum the shards across distributed-optimizer instances."""
        if not self.stage.shards_grads:
            for bucket in self.buckets:
                bucket.start_grad_reduction()
        for bucket in self.buckets:
            bucket.finish_grad_reduction()
        for buffer in self.buffers:
            buffer.all_reduce_across_instances()

    def reduced_gradients(self) -> list[torch.Tensor]:
        """After finish_grad_sync: the tensors holding this rank's reduced gradients (whole buffers, or the
        shards it owns), which a reduction across replica groups averages in place."""
        return [shard for buffer in self.buffers for shard in buffer.reduced_shards()]

    def grad_buffer_square_sum(self) -> torch.Tensor:
        """The sum of squares of this rank's gradient buffers as they are now. Before finish_grad_sync they hold
        this rank's own gradients, except the buckets that --overlap-grad-reduce (or ZeRO-2/3, at the end of
        each backward) has already reduced."""
        device = self.buffers[0].data.device if self.buffers else torch.device("cpu")
        return sum((torch.linalg.vector_norm(buffer.data) ** 2 for buffer in self.buffers),
                   torch.zeros((), device=device))

    def scale_gradients(self, factor: float | torch.Tensor) -> None:
        for buffer in self.buffers:
            buffer.data.mul_(factor)

    def main_grad_shards(self, params) -> list[torch.Tensor]:
        """1-D views of the reduced gradients this rank holds for `params` (whole, or its owned ranges);
        every rank of a data-parallel group gets the same list structure."""
        return [self.bucket_of[p].owned_grad(p) for p in params if p in self.bucket_of]

    def owned_ranges(self) -> list[OwnedRange]:
        """What this rank's optimizer steps: every parameter whole (no_shard), else its owned ranges."""
        return [r for bucket in self.buckets for r in bucket.owned_ranges()]

    def start_param_sync(self) -> None:
        """ZeRO-1/2, after the optimizer updated this rank's shards: all-gather every bucket's parameters
        (left in flight with --overlap-param-gather; forward pre-hooks wait for them). Buckets are laid out
        in backward order, so they are gathered in reverse: the first layers' parameters arrive first."""
        if not self.stage.gathers_params_after_step:
            return
        for bucket in reversed(self.buckets):
            bucket.start_param_gather()
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        for bucket in self.buckets:
            bucket.finish_param_gather()

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Every parameter whole and up to date inside the block (to read or write them outside forward:
        export, evaluation hooks); under ZeRO-3 they are sharded again afterwards."""
        self.finish_param_sync()
        for unit in self.units:
            unit.gather()
        try:
            yield
        finally:
            for unit in self.units:
                unit.free()

    def sharded_parameters(self) -> dict[str, FlatShard]:
        """The model weights this rank holds, by global name: whole parameters, or under ZeRO-3 the owned
        ranges of the persistent shards (the same FlatShard protocol as the optimizer's state)."""
        self.finish_param_sync()
        names = {param: name for name, param in self.module.named_global_parameters()}
        if not self.stage.shards_params:
            return {names[p]: FlatShard(p.detach().view(-1), p.spec, (0, p.numel())) for p in names}
        return {names[r.param]: FlatShard(r.model_data, r.param.spec, (r.start, r.stop))
                for r in self.owned_ranges()}

    def memory_footprint(self) -> dict[str, int]:
        """Bytes of parameter and gradient storage this chunk holds right now."""
        params = list(self.module.parameters()) + [b.param_shard for b in self.buckets if b.param_shard is not None]
        grads = [buffer.data for buffer in self.buffers] + [b.grad_data for b in self.buckets
                                                             if b.grad_data is not None]
        return {"params": storage_bytes(params), "grads": storage_bytes(grads)}
