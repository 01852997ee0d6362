"""Forward/backward schedules over the micro-batches of one global batch (Megatron's contract).

`forward_step_func(data_iterator, model) -> (output_tensor, loss_func)` runs one micro-batch forward;
`loss_func(output_tensor) -> (loss_sum, num_tokens, report)` turns the last stage's output into a
summed loss, its token count and values to log. Schedules backpropagate the summed loss (times the
loss scale); gradients are divided by the global token count afterwards (finalize_model_grads).
Every schedule returns (reports, local token count) for the micro-batches this rank computed a loss on.
"""

from __future__ import annotations

import contextlib

import torch


def _accumulate(reports: list[dict], total_tokens: torch.Tensor, loss_func, output) -> torch.Tensor:
    loss_sum, num_tokens, report = loss_func(output)
    reports.append(report)
    total_tokens += num_tokens.detach().to(total_tokens.dtype)
    return loss_sum


def forward_backward_no_pipelining(forward_step_func, data_iterator, model, num_microbatches: int, *,
                                   loss_scale: float = 1.0, forward_only: bool = False, **_):
    """All micro-batches on one stage: forward then backward each, reducing gradients only after the last."""
    chunk = model[0] if isinstance(model, list) else model
    reports, total_tokens = [], torch.zeros((), dtype=torch.float64)
    no_sync = getattr(chunk, "no_sync", contextlib.nullcontext)
    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        with contextlib.nullcontext() if (last or forward_only) else no_sync():
            output, loss_func = forward_step_func(data_iterator, chunk)
            loss_sum = _accumulate(reports, total_tokens, loss_func, output)
            if not forward_only:
                (loss_sum * loss_scale).backward()
    return reports, total_tokens
