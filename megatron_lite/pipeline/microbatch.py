"""One micro-batch on one model chunk, as every schedule runs it: forward (the loss on the last stage), then
backward whole or split into B and W (split_backward.py), with the rank's timeline and live micro-batches
kept in a ScheduleStats; the losses' normalisation (MicroBatchLosses); and the stage's communicator and the
receive-forward-send step of the non-interleaved schedules."""

from __future__ import annotations

import contextlib
import time

import torch

from megatron_lite.model.loss_scaling import LossScaling, scaled_loss
from megatron_lite.parallel import mappings
from megatron_lite.parallel.p2p import PipelineCommunicator, trace, trace_enabled
from megatron_lite.parallel.progress import RECORD
from megatron_lite.pipeline import split_backward


class MicroBatchLosses:
    """The losses of one schedule call on this rank: each micro-batch's report, the summed token count, and
    what each micro-batch backpropagates under --calculate-per-token-loss or the per-micro-batch mean
    (model/loss_scaling.py)."""

    def __init__(self, model_chunk: torch.nn.Module, pstate, config, num_microbatches: int, *, loss_scale: float,
                 forward_only: bool):
        per_token = config.training.calculate_per_token_loss or config.data.sft  # SFT: per assistant token
        self.scaling = LossScaling(1.0 if forward_only else loss_scale, per_token, num_microbatches, pstate.cp_size)
        self.forward_only = forward_only
        self.cp_group = pstate.group("cp")
        self.reports: list[dict] = []
        # float64, on the model's device, where the loss masks are
        self.tokens = torch.zeros((), dtype=torch.float64, device=next(model_chunk.parameters()).device)

    def backward_loss(self, loss_func, output) -> torch.Tensor:
        """The last stage's output -> the loss to backpropagate (the summed loss when forward only)."""
        loss_sum, num_tokens, report = loss_func(output)
        self.reports.append(report)
        num_tokens = num_tokens.detach().to(self.tokens.dtype)
        self.tokens += num_tokens
        if self.forward_only:
            return loss_sum
        if not self.scaling.per_token:  # the micro-batch's tokens: its whole sequences, summed over cp
            num_tokens = mappings.all_reduce(num_tokens.clone(), self.cp_group)
        return self.scaling.language_model_loss(loss_sum, num_tokens)

    def result(self):
        """(reports, the local token count finalize_model_grads divides by: None per micro-batch)."""
        return self.reports, self.tokens if self.scaling.per_token else None


class ScheduleStats:
    """What one schedule call did on this rank: its forward/backward timeline and live micro-batches.

    `events` holds (kind, chunk, micro-batch, start, end) in host wall-clock seconds, kind "F" (forward),
    "B" (backward, or its input-gradient part when split) or "W" (the weight-gradient part); idle time is
    the rest of the call (waiting for neighbours, and the sends and receives themselves). `peak_live` is
    the most micro-batches whose forward had run and whose backward (B) had not; `peak_held` the most
    whose graph was still kept, until W where the backward is split (else the same as `peak_live`).
    """

    def __init__(self):
        self.events: list[tuple[str, int, int, float, float]] = []
        self.start = self.end = time.perf_counter()
        self.live = self.held = 0
        self.peak_live = self.peak_held = 0

    @property
    def total_time(self) -> float:
        return self.end - self.start

    @property
    def busy_time(self) -> float:
        return sum(end - start for _, _, _, start, end in self.events)

    @property
    def idle_time(self) -> float:
        return self.total_time - self.busy_time

    def summary(self) -> str:
        """One line: busy/idle split, peak live micro-batches, then each event as kind+micro-batch/chunk."""
        timeline = " ".join(f"{kind}{mb}/{chunk}@{1e3 * (start - self.start):.1f}-{1e3 * (end - self.start):.1f}ms"
                            for kind, chunk, mb, start, end in self.events)
        return (f"busy {self.busy_time:.4f}s idle {self.idle_time:.4f}s "
                f"(idle/busy {self.idle_time / max(self.busy_time, 1e-12):.3f}) peak live micro-batches "
                f"{self.peak_live}, held {self.peak_held} | {timeline}")


def microbatch_step(what: str, microbatch: int, num_microbatches: int, chunk_id: int | None = None) -> str:
    """How the progress record (the hang report) names a step: 'forward of micro-batch 2 of 8 (model chunk 1)'."""
    chunk = f" (model chunk {chunk_id})" if chunk_id is not None else ""
    return f"{what} of micro-batch {microbatch + 1} of {num_microbatches}{chunk}"


class MicroBatchRunner:
    """Forward and backward of one micro-batch on one model chunk; keeps the reports, tokens and stats."""

    def __init__(self, forward_step_func, model: list, pstate, config, num_microbatches: int, *, loss_scale: float,
                 forward_only: bool, stats: ScheduleStats):
        self.forward_step_func = forward_step_func
        self.model = model
        self.pstate = pstate
        self.forward_only = forward_only
        self.stats = stats
        self.num_microbatches = num_microbatches
        stats.start = time.perf_counter()
        self.losses = MicroBatchLosses(model[0], pstate, config, num_microbatches, loss_scale=loss_scale,
                                       forward_only=forward_only)

    def _step(self, what: str, chunk_id: int, microbatch: int) -> str:
        return microbatch_step(what, microbatch, self.num_microbatches, chunk_id if len(self.model) > 1 else None)

    def computes_loss(self, chunk_id: int) -> bool:
        return self.pstate.is_last_stage and chunk_id == len(self.model) - 1

    def forward(self, chunk_id: int, microbatch: int, input_tensor, data_iterator) -> torch.Tensor:
        """The chunk's output activations [s(/tp), b, h], or the scaled loss on the last stage."""
        RECORD.set_step(self._step("forward", chunk_id, microbatch))
        start = time.perf_counter()
        chunk = self.model[chunk_id]
        if input_tensor is not None and not self.forward_only:
            input_tensor.requires_grad_()
        chunk.set_input_tensor(input_tensor)
        with scaled_loss(self.losses.scaling):  # for losses the layers attach
            output, loss_func = self.forward_step_func(data_iterator, chunk)
        if self.computes_loss(chunk_id):
            output = self.losses.backward_loss(loss_func, output)
        if not self.forward_only:
            self.stats.live += 1
            self.stats.held += 1
            self.stats.peak_live = max(self.stats.peak_live, self.stats.live)
            self.stats.peak_held = max(self.stats.peak_held, self.stats.held)
        self.stats.events.append(("F", chunk_id, microbatch, start, time.perf_counter()))
        return output

    def backward(self, chunk_id: int, microbatch: int, input_tensor, output_tensor, output_grad,
                 last_microbatch: bool):
        """Backpropagate one micro-batch; returns the gradient for the previous stage (None on the first).

        Gradient reduction stays deferred until the chunk's last micro-batch, whose backward may start it.
        """
        RECORD.set_step(self._step("backward", chunk_id, microbatch))
        start = time.perf_counter()
        chunk = self.model[chunk_id]
        no_sync = getattr(chunk, "no_sync", contextlib.nullcontext)
        with contextlib.nullcontext() if last_microbatch else no_sync():
            torch.autograd.backward(output_tensor, grad_tensors=output_grad)  # None: the loss itself
        self.stats.live -= 1
        self.stats.held -= 1
        self.stats.events.append(("B", chunk_id, microbatch, start, time.perf_counter()))
        return input_tensor.grad if input_tensor is not None else None

    def backward_input(self, chunk_id: int, microbatch: int, input_tensor, output_tensor, output_grad):
        """B: the gradient for the previous stage only (None on the first); returns it and the micro-batch's W."""
        RECORD.set_step(self._step("input backward", chunk_id, microbatch))
        start = time.perf_counter()
        params = list(self.model[chunk_id].parameters())
        input_grad, weight_pass = split_backward.backward_input(output_tensor, output_grad, input_tensor, params)
        self.stats.live -= 1
        self.stats.events.append(("B", chunk_id, microbatch, start, time.perf_counter()))
        return input_grad, weight_pass

    def backward_weight(self, chunk_id: int, microbatch: int, weight_pass: split_backward.WeightGradientPass,
                        last_microbatch: bool):
        """W: accumulate one micro-batch's weight gradients; the last micro-batch's may start their reduction."""
        RECORD.set_step(self._step("weight backward", chunk_id, microbatch))
        start = time.perf_counter()
        chunk = self.model[chunk_id]
        no_sync = getattr(chunk, "no_sync", contextlib.nullcontext)
        with contextlib.nullcontext() if last_microbatch else no_sync():
            weight_pass.run()
        self.stats.held -= 1
        self.stats.events.append(("W", chunk_id, microbatch, start, time.perf_counter()))

    def finish(self):
        """Close the timeline; the schedule's return value (MicroBatchLosses.result)."""
        self.stats.end = time.perf_counter()
        if trace_enabled():
            trace(f"rank {self.pstate.rank} stage {self.pstate.pp_rank} {self.stats.summary()}")
        return self.losses.result()


def stage_communicator(model: list, pstate, config) -> PipelineCommunicator:
    """Activations between stages are [s/cp, mbs, h], the sequence also split over TP with sequence
    parallelism, in the dtype of the model's parameters."""
    m, p = config.model, config.parallel
    seq = m.seq_length // p.context_parallel_size
    if p.sequence_parallel:
        seq //= p.tensor_model_parallel_size
    param = next(model[0].parameters())
    return PipelineCommunicator(pstate, (seq, config.training.micro_batch_size, m.hidden_size), param.dtype,
                                param.device)


def receive_forward_send(run: MicroBatchRunner, comm: PipelineCommunicator, mb: int, data_iterator):
    """One micro-batch through a stage of a non-interleaved pipeline: receive its input (None on the first
    stage), run the forward, send the output on (not past the last stage); returns (input, output)."""
    input_tensor = comm.recv_forward((mb, 0))
    output = run.forward(0, mb, input_tensor, data_iterator)
    comm.send_forward(output, (mb, 0))
    return input_tensor, output
