"""Where the fp32 masters of the ranges an optimizer steps live: on the model's device, or in host memory.

Adam's state costs 12 bytes per element a rank steps (fp32 master 4, two fp32 moments 8; an fp32 weight is
its own master), most of what a distributed-optimizer rank holds. `--optimizer-cpu-offload` (Megatron's
flag, ZeRO-Offload's idea) keeps it in host memory instead and runs AdamW there: each step the reduced
gradients of the offloaded ranges are copied device -> host, the host masters are stepped, and the updated
values are copied host -> device into the parameters (under the distributed optimizer into this rank's
shard of the bucket, which is then all-gathered as without offload). `--optimizer-offload-fraction f`
offloads the leading ranges, in the optimizer's order, whose elements come nearest f x all the elements
this rank steps; a range is never split, as its state is one checkpoint shard.

Host memory per offloaded element: the fp32 master (its own copy even for an fp32 weight, whose device
value is then a copy of it), two fp32 moments, an fp32 gradient, and for bf16/fp16 weights a copy in the
weight's dtype, which is what crosses to the device (half the bytes of fp32). With the model on CUDA the
gradient, master and outgoing buffers are pinned (one allocation each, which torch's pinned allocator
rounds up to a power of two) and both copies are `non_blocking`: the host goes on to issue the next
forward while the weights travel, and that forward's kernels queue behind the copies on the same stream
(no side stream). Why no host buffer is written while a copy still reads it: every copy is issued on the
current stream, and before stepping the host waits for that stream, to read the gradients, which also
completes the copies of the previous step.

On a CPU-only machine the device is the CPU too; the offloaded state is still separate host tensors, copied as on a
GPU, so tests run this path. The host step uses torch's default CPU AdamW there, the same as the device step on a
CPU, so an offloaded run equals a plain one bitwise and a run can switch at a checkpoint; with the model on an
accelerator it uses torch's fused CPU AdamW (faster than the default). Checkpoints hold the same keys and values
either way (optim/distributed_optimizer.py).
"""

from __future__ import annotations

import torch

from megatron_lite.optim.param_and_grad_buffer import OwnedRange, storage_bytes


def offloaded_count(numels: list[int], fraction: float) -> int:
    """How many leading ranges to offload: the prefix whose elements come nearest `fraction` of the total
    (on a tie, the shorter)."""
    target = fraction * sum(numels)
    best, best_distance, total = 0, target, 0
    for count, numel in enumerate(numels, start=1):
        total += numel
        if abs(total - target) < best_distance:
            best, best_distance = count, abs(total - target)
    return best


def _flat_views(buffer: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    views, start = [], 0
    for size in sizes:
        views.append(buffer[start:start + size])
        start += size
    return views


class DeviceMasters:
    """fp32 masters on the model's device: the weight itself when it is fp32, else an fp32 copy of it."""

    def __init__(self, ranges: list[OwnedRange]):
        self.ranges = ranges
        self.masters = [r.model_data if r.model_data.dtype == torch.float32 else r.model_data.float() for r in ranges]
        self.fused_adam = bool(ranges) and ranges[0].model_data.is_cuda

    def grads_for_step(self) -> list[torch.Tensor]:
        return [r.grad for r in self.ranges]

    def copy_to_model(self) -> None:
        for owned, master in zip(self.ranges, self.masters):
            if master is not owned.model_data:
                owned.model_data.copy_(master)

    def footprint(self) -> list[torch.Tensor]:
        """The masters that are not the model's own storage."""
        model = {r.model_data.untyped_storage().data_ptr() for r in self.ranges}
        return [m for m in self.masters if m.untyped_storage().data_ptr() not in model]


class HostMasters:
    """fp32 masters in host memory, with the host buffers the gradients arrive in and the weights leave from."""

    def __init__(self, ranges: list[OwnedRange]):
        self.ranges = ranges
        device = ranges[0].model_data.device
        self.pinned = device.type == "cuda"
        self.fused_adam = device.type != "cpu"  # see the module docstring
        sizes = [r.stop - r.start for r in ranges]
        total = sum(sizes)
        self.masters = _flat_views(torch.empty(total, dtype=torch.float32, pin_memory=self.pinned), sizes)
        self.grads = _flat_views(torch.empty(total, dtype=torch.float32, pin_memory=self.pinned), sizes)
        for owned, master in zip(ranges, self.masters):
            master.copy_(owned.model_data)
        self.outgoing = list(self.masters)  # fp32 weights leave from their masters
        for dtype in {r.model_data.dtype for r in ranges} - {torch.float32}:
            members = [i for i, r in enumerate(ranges) if r.model_data.dtype == dtype]
            buffer = torch.empty(sum(sizes[i] for i in members), dtype=dtype, pin_memory=self.pinned)
            for index, view in zip(members, _flat_views(buffer, [sizes[i] for i in members])):
                self.outgoing[index] = view

    def grads_for_step(self) -> list[torch.Tensor]:
        """Copy the reduced gradients to the host; wait until they (and the previous step's copies) are there."""
        for owned, grad in zip(self.ranges, self.grads):
            grad.copy_(owned.grad, non_blocking=self.pinned)
        if self.pinned:
            torch.cuda.current_stream(self.ranges[0].grad.device).synchronize()
        return self.grads

    def copy_to_model(self) -> None:
        """Cast the masters to the weights' dtype on the host and send them into the model's storage."""
        for owned, master, outgoing in zip(self.ranges, self.masters, self.outgoing):
            if outgoing is not master:
                outgoing.copy_(master)
            owned.model_data.copy_(outgoing, non_blocking=self.pinned)

    def footprint(self) -> list[torch.Tensor]:
        return self.masters

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the host buffers the gradients arrive in and the low-precision weights leave from."""
        outgoing = [o for o, m in zip(self.outgoing, self.masters) if o is not m]
        return {"grads": storage_bytes(self.grads), "outgoing": storage_bytes(outgoing)}
