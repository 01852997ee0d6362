"""Forward/backward schedules over the micro-batches of one global batch (Megatron's contract).

`forward_step_func(data_iterator, model) -> (output_tensor, loss_func)` runs one micro-batch forward;
`loss_func(output_tensor) -> (loss_sum, num_tokens, report)` turns the last stage's output into a
summed loss, its token count and values to log. Schedules backpropagate, as Megatron's, the micro-batch's
mean loss / m by default, the summed loss with --calculate-per-token-loss (times the fp16 loss scale;
model/loss_scaling.py); finalize_model_grads then divides by dp x cp, or by the global token count.
Every schedule returns (reports, local token count) for the micro-batches this rank computed a loss
on, with pipelining only the last stage's; the count, what finalize_model_grads divides by, is None for
the per-micro-batch mean.

  forward_backward_no_pipelining                   one stage: forward and backward each micro-batch
  forward_backward_pipelining_without_interleaving 1F1B: warm-up forwards, one-forward-one-backward
                                                   steady state, cool-down backwards
  forward_backward_pipelining_with_interleaving    interleaved 1F1B over v model chunks per stage
  forward_backward_pipelining_gpipe                GPipe: all forwards, then all backwards
  forward_backward_pipelining_zero_bubble          ZB-H1: 1F1B with each backward split into B (input
                                                   gradient) and W (weight gradients), W delayed

In 1F1B stage p of P runs P - p - 1 warm-up forwards, so it holds at most P - p micro-batches' activations
(GPipe holds all m) and idles (P - 1) micro-batch times per step: the bubble is (P - 1) / m of the
compute, in both. ZB-H1 sends each gradient back after B alone and fills the waits with delayed W
passes: the bubble drops to (P - 1)(t_F + t_B - t_W) / (m (t_F + t_B + t_W)), a third of 1F1B's when the
three take equal time. The interleaved schedule gives each stage v chunks of L / (P v) layers and cuts
the bubble to (P - 1) / (v m), holding more micro-batches in flight in exchange. An activation is dropped as soon
as its backward has run. Gradient reduction is deferred (`no_sync`) until the last micro-batch's
backward of each chunk, so with --overlap-grad-reduce a chunk's buckets start reducing then.

Pass a `ScheduleStats` (microbatch.py) as `stats=` to get this rank's timeline (forward, backward,
weight-gradient, idle) and its peak numbers of live and held micro-batches; with MEGATRON_LITE_PP_TRACE=1
every send/recv and a per-stage summary are printed to stderr.
"""

from __future__ import annotations

import contextlib

from megatron_lite.model.loss_scaling import scaled_loss
from megatron_lite.parallel.progress import RECORD
from megatron_lite.pipeline.microbatch import (
    MicroBatchLosses,
    MicroBatchRunner,
    ScheduleStats,
    microbatch_step,
    receive_forward_send,
    stage_communicator,
)


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches: int, *, pstate,
                                   config, loss_scale: float = 1.0, forward_only: bool = False, **_):
    """All micro-batches on one stage: forward then backward each, reducing gradients only after the last."""
    chunk = model[0] if isinstance(model, list) else model
    losses = MicroBatchLosses(chunk, pstate, config, num_microbatches, loss_scale=loss_scale,
                              forward_only=forward_only)
    no_sync = getattr(chunk, "no_sync", contextlib.nullcontext)
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        with contextlib.nullcontext() if (last or forward_only) else no_sync():
            RECORD.set_step(microbatch_step("forward", index, num_microbatches))
            with scaled_loss(losses.scaling):  # for losses the layers attach
                output, loss_func = forward_step_func(data_iterator, chunk)
            loss = losses.backward_loss(loss_func, output)
            if not forward_only:
                RECORD.set_step(microbatch_step("backward", index, num_microbatches))
                loss.backward()
    return losses.result()


# -------------------------------------------------------------------------------------------------------
# 1F1B


def _warmup_forwards(pstate, num_microbatches: int) -> int:
    """Forwards stage p of P runs before its first backward: P - p - 1, or all m micro-batches if fewer."""
    return min(pstate.pp_size - pstate.pp_rank - 1, num_microbatches)


def _one_forward_one_backward(run: MicroBatchRunner, comm, data_iterator, num_microbatches: int,
                              backward_and_send) -> None:
    """1F1B's order of passes on one stage, which 1F1B and ZB-H1 share: warm-up forwards; then steps of one
    forward, its output sent while the gradient of the oldest micro-batch is received, and that micro-batch's
    backward; then the cool-down backwards of the micro-batches left.

    `backward_and_send(mb, input, output, output_grad, next_forward_mb)` backpropagates micro-batch `mb` and
    sends its input gradient back, receiving with it the input of micro-batch `next_forward_mb` (None in the
    last steady step and the cool-down), which it returns. The two schedules differ only there.
    """
    m = num_microbatches
    num_warmup = m if run.forward_only else _warmup_forwards(run.pstate, m)
    num_steady = m - num_warmup
    saved: list[tuple] = []  # (input, output) of micro-batches whose backward is still to run, oldest first

    for mb in range(num_warmup):
        input_and_output = receive_forward_send(run, comm, mb, data_iterator)
        if not run.forward_only:
            saved.append(input_and_output)

    input_tensor = comm.recv_forward((num_warmup, 0)) if num_steady else None
    for step in range(num_steady):
        forward_mb, backward_mb = num_warmup + step, step
        saved.append((input_tensor, run.forward(0, forward_mb, input_tensor, data_iterator)))
        output_grad = comm.send_forward_recv_backward(saved[-1][1], (forward_mb, 0), (backward_mb, 0))
        next_forward_mb = forward_mb + 1 if step < num_steady - 1 else None
        # Only `saved` holds a micro-batch's input and output, and only the call the oldest's, so they go when
        # it returns (under ZB-H1 the output still holds the loss's part of the graph, which B keeps for W).
        input_tensor = backward_and_send(backward_mb, *saved.pop(0), output_grad, next_forward_mb)

    if not run.forward_only:
        for backward_mb in range(num_steady, m):
            output_grad = comm.recv_backward((backward_mb, 0))
            backward_and_send(backward_mb, *saved.pop(0), output_grad, None)


def forward_backward_pipelining_without_interleaving(forward_step_func, data_iterator, model,
                                                     num_microbatches: int, *, pstate, config,
                                                     forward_only: bool = False, loss_scale: float = 1.0,
                                                     stats: ScheduleStats | None = None):
    """1F1B (PipeDream-Flush): warm-up forwards, then alternate one forward and one backward, then cool down.

    Stage p runs min(P - p - 1, m) warm-up forwards; each steady-state step sends its output while
    receiving the gradient of its oldest micro-batch, so at most P - p micro-batches are live. A backward
    is whole, and its input gradient goes back with the receive of the next input in one exchange.
    """
    model = model if isinstance(model, list) else [model]
    stats = stats if stats is not None else ScheduleStats()
    run = MicroBatchRunner(forward_step_func, model, pstate, config, num_microbatches, loss_scale=loss_scale,
                           forward_only=forward_only, stats=stats)
    comm = stage_communicator(model, pstate, config)

    def backward_and_send(mb: int, input_tensor, output, output_grad, next_forward_mb: int | None):
        input_grad = run.backward(0, mb, input_tensor, output, output_grad, mb == num_microbatches - 1)
        if next_forward_mb is None:
            comm.send_backward(input_grad, (mb, 0))
            return None
        return comm.send_backward_recv_forward(input_grad, (mb, 0), (next_forward_mb, 0))

    _one_forward_one_backward(run, comm, data_iterator, num_microbatches, backward_and_send)
    return run.finish()


# -------------------------------------------------------------------------------------------------------
# GPipe


def forward_backward_pipelining_gpipe(forward_step_func, data_iterator, model, num_microbatches: int, *,
                                      pstate, config, forward_only: bool = False, loss_scale: float = 1.0,
                                      stats: ScheduleStats | None = None):
    """GPipe (Huang et al. 2019): the forwards of all m micro-batches, then their backwards in the same order.

    The bubble is 1F1B's, (P - 1) / m, but every stage holds all m micro-batches' activations when the
    forwards end (1F1B: at most P - p); the backwards pass each gradient on as soon as it is computed.
    """
    model = model if isinstance(model, list) else [model]
    stats = stats if stats is not None else ScheduleStats()
    run = MicroBatchRunner(forward_step_func, model, pstate, config, num_microbatches, loss_scale=loss_scale,
                           forward_only=forward_only, stats=stats)
    comm = stage_communicator(model, pstate, config)
    saved: list[tuple] = []  # (input, output) of every micro-batch, oldest first
    for mb in range(num_microbatches):
        input_and_output = receive_forward_send(run, comm, mb, data_iterator)
        if not forward_only:
            saved.append(input_and_output)
    for mb in range(len(saved)):
        input_tensor, output = saved.pop(0)  # the activations go as soon as their backward has run
        output_grad = comm.recv_backward((mb, 0))
        input_grad = run.backward(0, mb, input_tensor, output, output_grad, mb == num_microbatches - 1)
        comm.send_backward(input_grad, (mb, 0))
    return run.finish()

# -------------------------------------------------------------------------------------------------------
# ZB-H1


def forward_backward_pipelining_zero_bubble(forward_step_func, data_iterator, model, num_microbatches: int, *,
                                            pstate, config, forward_only: bool = False, loss_scale: float = 1.0,
                                            stats: ScheduleStats | None = None):
    """ZB-H1 (Qi et al. 2023): 1F1B whose backwards send the input gradient after B alone, the W passes delayed.

    The order of forwards and backwards (B) is 1F1B's. Stage p runs 1F1B's P - p - 1 warm-up forwards; in
    its first p steady steps (forward, B) it leaves the W passes for later, and from then on runs the oldest
    waiting W after each B, while B's gradient and the next input travel, so at most P micro-batches wait
    for their W on any stage (1F1B: P - p, the same P on the first stage, the one that holds the most). The
    p W passes still waiting at the end fill the cool-down, where 1F1B's stage p idles waiting for
    gradients. Forward-only runs are 1F1B's.
    """
    if forward_only:
        return forward_backward_pipelining_without_interleaving(
            forward_step_func, data_iterator, model, num_microbatches, pstate=pstate, config=config,
            forward_only=True, loss_scale=loss_scale, stats=stats)
    model = model if isinstance(model, list) else [model]
    stats = stats if stats is not None else ScheduleStats()
    run = MicroBatchRunner(forward_step_func, model, pstate, config, num_microbatches, loss_scale=loss_scale,
                           forward_only=False, stats=stats)
    comm = stage_communicator(model, pstate, config)
    m = num_microbatches
    # The B of micro-batches before this one leave their W waiting: the first p steady steps' (fewer when
    # there are fewer steady steps); every later B, the cool-down's included, is followed by the oldest W.
    first_followed_by_weight = min(pstate.pp_rank, m - _warmup_forwards(pstate, m))
    waiting: list[tuple] = []  # (micro-batch, W pass) whose W is still to run, oldest first

    def run_oldest_weight_pass():
        mb, weight_pass = waiting.pop(0)
        run.backward_weight(0, mb, weight_pass, mb == m - 1)

    def backward_and_send(mb: int, input_tensor, output, output_grad, next_forward_mb: int | None):
        """B, then send its gradient back and post the receive of the next input, run the oldest W while
        they travel, and wait for both; returns the next input (None on the first stage or without one)."""
        input_grad, weight_pass = run.backward_input(0, mb, input_tensor, output, output_grad)
        waiting.append((mb, weight_pass))
        first = pstate.is_first_stage
        recv = None if first or next_forward_mb is None else (next_forward_mb, 0)
        next_input, _, handles = comm.post(send_prev=None if first else input_grad, send_prev_label=(mb, 0),
                                           recv_prev=recv)
        if mb >= first_followed_by_weight:
            run_oldest_weight_pass()
        for handle in handles:
            handle.wait()
        return next_input

    _one_forward_one_backward(run, comm, data_iterator, m, backward_and_send)
    while waiting:
        run_oldest_weight_pass()
    return run.finish()


# -------------------------------------------------------------------------------------------------------
# Interleaved 1F1B


class _MicroBatchFeed:
    """Serves each micro-batch of one data iterator to every model chunk: read once, handed to v chunks.

    Every chunk's forward calls `next(data_iterator)` for its micro-batch, and the interleaved order visits
    micro-batches out of sequence (chunk 1 of micro-batch 0 after chunk 0 of micro-batches 0..P-1).
    """

    def __init__(self, data_iterator, num_chunks: int):
        self.source = data_iterator
        self.num_chunks = num_chunks
        self.batches: dict[int, object] = {}
        self.served: dict[int, int] = {}
        self.num_read = 0

    def iterator_for(self, microbatch: int):
        return None if self.source is None else self._one(microbatch)

    def _one(self, microbatch: int):
        while self.num_read <= microbatch:
            self.batches[self.num_read] = next(self.source)
            self.served[self.num_read] = 0
            self.num_read += 1
        self.served[microbatch] += 1
        batch = self.batches[microbatch]
        if self.served[microbatch] == self.num_chunks:
            del self.batches[microbatch]
        yield batch


def forward_backward_pipelining_with_interleaving(forward_step_func, data_iterator, model,
                                                  num_microbatches: int, *, pstate, config,
                                                  forward_only: bool = False, loss_scale: float = 1.0,
                                                  stats: ScheduleStats | None = None):
    """Interleaved 1F1B: v model chunks per stage, micro-batches in groups of P per chunk (Megatron's order).

    Forward number k (of m v on this rank) runs chunk (k mod P v) // P on micro-batch (k // P v) P + k mod P;
    backwards visit the chunks in reverse. Stage p warms up with 2 (P - p - 1) + (v - 1) P forwards (all of
    them when m = P), then alternates, sending its output and gradient and receiving the next ones in one
    exchange. Stages form a ring: the last stage's chunk c feeds the first stage's chunk c + 1.
    """
    v, pp, m = len(model), pstate.pp_size, num_microbatches
    if m % pp:
        raise ValueError(f"the interleaved schedule needs the micro-batch count ({m}) divisible by the "
                         f"pipeline size ({pp})")
    stats = stats if stats is not None else ScheduleStats()
    run = MicroBatchRunner(forward_step_func, model, pstate, config, num_microbatches, loss_scale=loss_scale,
                           forward_only=forward_only, stats=stats)
    comm = stage_communicator(model, pstate, config)
    feed = _MicroBatchFeed(data_iterator, v)
    total = m * v
    all_warmup = forward_only or m == pp
    num_warmup = total if all_warmup else min((pp - pstate.pp_rank - 1) * 2 + (v - 1) * pp, total)
    num_steady = total - num_warmup
    first, last = pstate.is_first_stage, pstate.is_last_stage

    def chunk_of(k: int, forward: bool) -> int:
        chunk = (k % (pp * v)) // pp
        return chunk if forward else v - 1 - chunk

    def microbatch_of(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    inputs = [[] for _ in range(v)]  # received activations waiting for their forward, per chunk
    grads = [[] for _ in range(v)]  # received output gradients waiting for their backward, per chunk
    saved = [[] for _ in range(v)]  # (input, output) waiting for backward, per chunk, oldest first
    inputs_arrived, grads_arrived = [0] * v, [0] * v  # per chunk: the micro-batch the next arrival is for

    def expect_input(chunk: int):
        return inputs_arrived[chunk], chunk

    def expect_grad(chunk: int):
        return grads_arrived[chunk], chunk

    def store(chunk_input, chunk_grad, from_prev, from_next):
        if chunk_input is not None:
            inputs[chunk_input].append(from_prev)
            inputs_arrived[chunk_input] += 1
        if chunk_grad is not None:
            grads[chunk_grad].append(from_next)
            grads_arrived[chunk_grad] += 1

    def forward_k(k: int):
        chunk, mb = chunk_of(k, True), microbatch_of(k)
        input_tensor = None if (first and chunk == 0) else inputs[chunk].pop(0)
        output = run.forward(chunk, mb, input_tensor, feed.iterator_for(mb))
        if not forward_only:
            saved[chunk].append((input_tensor, output))
        # [s(/tp), b, h] to the next stage; nothing after the loss
        return (None if run.computes_loss(chunk) else output), (mb, chunk)

    def backward_k(k: int):
        chunk, mb = chunk_of(k, False), microbatch_of(k)
        input_tensor, output = saved[chunk].pop(0)
        output_grad = None if run.computes_loss(chunk) else grads[chunk].pop(0)
        input_grad = run.backward(chunk, mb, input_tensor, output, output_grad, mb == m - 1)
        return input_grad, (mb, chunk)  # None on the first stage's first chunk

    if not first:
        store(0, None, comm.communicate(recv_prev=expect_input(0))[0], None)
    for k in range(num_warmup):
        send, send_label = forward_k(k)
        next_chunk = chunk_of(k + 1, True)
        recv_prev = not (first and next_chunk == 0) and k != total - 1
        recv_next = k == num_warmup - 1 and not all_warmup and not last
        from_prev, from_next = comm.communicate(
            send_next=send, send_next_label=send_label,
            recv_prev=expect_input(next_chunk) if recv_prev else None,
            recv_next=expect_grad(v - 1) if recv_next else None)
        store(next_chunk if recv_prev else None, v - 1 if recv_next else None, from_prev, from_next)

    for step in range(num_steady):
        k_forward, k_backward = num_warmup + step, step
        send, send_label = forward_k(k_forward)
        input_grad, grad_label = backward_k(k_backward)
        # Which chunk the next arrivals are for: the first stage runs P - 1 forwards ahead of the last
        # one, whose outputs wrap around to this stage's next chunk (and symmetrically for gradients).
        if first:
            next_forward_chunk = chunk_of(k_forward - (pp - 1), True) + 1
            recv_prev = next_forward_chunk != v
        else:
            next_forward_chunk, recv_prev = chunk_of(k_forward + 1, True), True
        if last:
            next_backward_chunk = chunk_of(k_backward - (pp - 1), False) - 1
            recv_next = next_backward_chunk != -1
        else:
            next_backward_chunk, recv_next = chunk_of(k_backward + 1, False), True
        recv_prev = recv_prev and step != num_steady - 1
        from_prev, from_next = comm.communicate(
            send_next=send, send_next_label=send_label, send_prev=input_grad, send_prev_label=grad_label,
            recv_prev=expect_input(next_forward_chunk) if recv_prev else None,
            recv_next=expect_grad(next_backward_chunk) if recv_next else None)
        store(next_forward_chunk if recv_prev else None, next_backward_chunk if recv_next else None,
              from_prev, from_next)

    if not forward_only:
        if all_warmup and not last:
            store(None, v - 1, None, comm.communicate(recv_next=expect_grad(v - 1))[1])
        for k in range(num_steady, total):
            input_grad, grad_label = backward_k(k)
            next_chunk = chunk_of(k + 1, False)
            recv_next = not (last and next_chunk == v - 1) and k != total - 1
            from_next = comm.communicate(send_prev=input_grad, send_prev_label=grad_label,
                                         recv_next=expect_grad(next_chunk) if recv_next else None)[1]
            store(None, next_chunk if recv_next else None, None, from_next)
    return run.finish()
