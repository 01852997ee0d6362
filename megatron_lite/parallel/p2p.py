"""Pipeline point-to-point: activations to the next stage, their gradients back to the previous one.

Every exchange between neighbouring stages posts plain `isend`/`irecv` operations in a fixed order and
then waits for all of them. Batched p2p (`batch_isend_irecv`) is known to hang on gloo in pipeline use
(PiPPy #989, pytorch #132644); posting every operation before waiting on any means no stage can block
its neighbour, and the even/odd ordering below (Megatron's) pairs each send with the receive its
neighbour posts at the same point of the schedule.

Stages form a ring: the next stage of the last one is the first. The interleaved schedule uses the
wrap-around to hand a micro-batch from the last stage's chunk c to the first stage's chunk c + 1; the
1F1B wrappers never send past the ends. Activations and gradients travel under different tags, so
one pair of ranks (two stages with virtual stages) can carry both in the same exchange.

Tensor shapes are known in advance ([s/cp, mbs, h], the sequence also split over TP with sequence
parallelism), so no shape is ever sent. With MEGATRON_LITE_PP_TRACE=1 every operation is logged to
stderr with rank, peer, direction, micro-batch and model chunk as it is posted: where a pipeline hangs,
the last unmatched line says which message never came.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState

TRACE_ENV = "MEGATRON_LITE_PP_TRACE"
ACTIVATION_TAG, GRADIENT_TAG = 1, 2

Label = tuple[int, int]  # (micro-batch, model chunk) a tensor belongs to on the rank that logs it


def trace_enabled() -> bool:
    return os.environ.get(TRACE_ENV, "0") not in ("", "0")


def trace(message: str) -> None:
    print(f"[pp-trace {time.perf_counter():.6f}] {message}", file=sys.stderr, flush=True)


class PipelineCommunicator:
    """Sends and receives fixed-shape tensors between this stage and its ring neighbours in the pipeline."""

    def __init__(self, pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.pstate = pstate
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.group = pstate.group("pp")
        size, stage = pstate.pp_size, pstate.pp_rank
        self.next_rank = pstate.pp_ranks[(stage + 1) % size]
        self.prev_rank = pstate.pp_ranks[(stage - 1) % size]
        self.trace = trace_enabled()

    def communicate(self, *, send_next: torch.Tensor | None = None, send_next_label: Label | None = None,
                    send_prev: torch.Tensor | None = None, send_prev_label: Label | None = None,
                    recv_prev: Label | None = None, recv_next: Label | None = None):
        """One exchange with both neighbours; returns (activation from prev, gradient from next).

        `send_next` is an activation for the next stage, `send_prev` a gradient for the previous one;
        `recv_prev` / `recv_next` name the (micro-batch, chunk) expected, or None to receive nothing.
        """
        from_prev, from_next, handles = self.post(send_next=send_next, send_next_label=send_next_label,
                                                  send_prev=send_prev, send_prev_label=send_prev_label,
                                                  recv_prev=recv_prev, recv_next=recv_next)
        for handle in handles:
            handle.wait()
        return from_prev, from_next

    def post(self, *, send_next: torch.Tensor | None = None, send_next_label: Label | None = None,
             send_prev: torch.Tensor | None = None, send_prev_label: Label | None = None,
             recv_prev: Label | None = None, recv_next: Label | None = None):
        """`communicate` without the wait: (activation buffer, gradient buffer, handles), the buffers filled
        once every handle has been waited on. A stage can compute while its neighbours take their messages
        (gloo's send completes only when the matching receive is posted)."""
        from_prev = self._buffer() if recv_prev is not None else None
        from_next = self._buffer() if recv_next is not None else None
        ops = [
            ("send", send_next, self.next_rank, ACTIVATION_TAG, send_next_label),
            ("recv", from_prev, self.prev_rank, ACTIVATION_TAG, recv_prev),
            ("send", send_prev, self.prev_rank, GRADIENT_TAG, send_prev_label),
            ("recv", from_next, self.next_rank, GRADIENT_TAG, recv_next),
        ]
        if self.pstate.pp_rank % 2:  # odd stages receive first, matching the even stages' sends
            ops = [ops[1], ops[0], ops[3], ops[2]]
        handles = []
        for kind, tensor, peer, tag, label in ops:
            if tensor is None:
                continue
            if self.trace:
                what = "activation" if tag == ACTIVATION_TAG else "gradient"
                arrow = "->" if kind == "send" else "<-"
                trace(f"rank {self.pstate.rank} {arrow} rank {peer} {kind} {what} "
                      f"microbatch {label[0]} chunk {label[1]}")
            if kind == "send":
                handles.append(mappings.isend(tensor.contiguous(), peer, self.group, tag))
            else:
                handles.append(mappings.irecv(tensor, peer, self.group, tag))
        return from_prev, from_next, handles

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    # The exchanges of 1F1B, named as in Megatron; nothing goes past the first or last stage.
    def recv_forward(self, label: Label) -> torch.Tensor | None:
        if self.pstate.is_first_stage:
            return None
        return self.communicate(recv_prev=label)[0]

    def send_forward(self, tensor: torch.Tensor, label: Label) -> None:
        if not self.pstate.is_last_stage:
            self.communicate(send_next=tensor, send_next_label=label)

    def recv_backward(self, label: Label) -> torch.Tensor | None:
        if self.pstate.is_last_stage:
            return None
        return self.communicate(recv_next=label)[1]

    def send_backward(self, tensor: torch.Tensor | None, label: Label) -> None:
        if not self.pstate.is_first_stage:
            self.communicate(send_prev=tensor, send_prev_label=label)

    def send_forward_recv_backward(self, tensor: torch.Tensor, send_label: Label,
                                   recv_label: Label) -> torch.Tensor | None:
        if self.pstate.is_last_stage:
            return None
        return self.communicate(send_next=tensor, send_next_label=send_label, recv_next=recv_label)[1]

    def send_backward_recv_forward(self, tensor: torch.Tensor | None, send_label: Label,
                                   recv_label: Label) -> torch.Tensor | None:
        if self.pstate.is_first_stage:
            return None
        return self.communicate(send_prev=tensor, send_prev_label=send_label, recv_prev=recv_label)[0]
