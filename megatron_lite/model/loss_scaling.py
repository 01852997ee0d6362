"""How one micro-batch's losses are weighted in the backward pass: the loss normalisation and the fp16 loss scale.

Megatron's two normalisations of the language-model loss (--calculate-per-token-loss):

  per micro-batch (the default)  a micro-batch's loss is the mean over its unmasked tokens, and the gradient is
                                 that of the mean of these means over the micro-batches of the global batch
                                 (m on each of the dp ranks). The schedule backpropagates each micro-batch's
                                 summed loss x cp / (its tokens x m); finalize_model_grads divides the
                                 gradients, summed over dp x cp, by dp x cp (Megatron's DDP average).
  per token                      the gradient is that of the mean over every unmasked token of the global
                                 batch: the schedule backpropagates the summed loss, finalize_model_grads
                                 divides by the global batch's token count.

Without a loss mask every micro-batch holds micro-batch-size x seq-length tokens and the two are the same.
A micro-batch's tokens are those of its whole sequences: under context parallelism the schedule sums the cp
ranks' counts, so each rank's share is divided by the count of the micro-batch it belongs to, and the
result does not depend on the layout. (Megatron-Core up to 0.12 did the same; from 0.13 each cp rank divides
by its own share's count: where a mask leaves the shares unequal, that differs from this and from cp = 1.)

A layer that feeds a loss of its own into the backward pass (the MoE balancing losses,
model/moe_router.MoEAuxLossAutoScaler) is a mean over the T tokens of a micro-batch; as in Megatron it
weighs 1 / (m dp) in the gradient in either normalisation when nothing is masked: per micro-batch it enters
with weight cp / m (its cp ranks' shares add up over the reduction, which divides by dp x cp), per token
with weight T (the division by the global count N makes it T / N). The fp16 loss scale multiplies every
loss. The schedule runs each forward inside `scaled_loss(scaling)`, as torch.autocast scopes a dtype, and a
layer reads `auxiliary_loss_weight(T)` during its forward, so no built module is changed from outside.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossScaling:
    """How a schedule weighs each micro-batch's losses before backpropagating them."""

    loss_scale: float = 1.0  # fp16's; 1 otherwise
    per_token: bool = True  # --calculate-per-token-loss; False: the per-micro-batch mean
    num_microbatches: int = 1  # m, on each data-parallel rank
    cp_size: int = 1

    def language_model_loss(self, loss_sum: torch.Tensor, microbatch_tokens: torch.Tensor) -> torch.Tensor:
        """What the schedule backpropagates for one micro-batch: this rank's summed loss, divided per micro-batch
        by the unmasked tokens of the whole micro-batch (`microbatch_tokens`, at least 1 as in Megatron)."""
        if self.per_token:
            return loss_sum * self.loss_scale
        weight = self.cp_size * self.loss_scale / self.num_microbatches
        return loss_sum * weight / microbatch_tokens.to(loss_sum.dtype).clamp(min=1.0)

    def auxiliary_loss_weight(self, num_tokens: int) -> float:
        """The weight of a layer's own loss, a mean over the micro-batch's `num_tokens` tokens."""
        if self.per_token:
            return num_tokens * self.loss_scale
        return self.cp_size * self.loss_scale / self.num_microbatches


_SCALING: contextvars.ContextVar[LossScaling] = contextvars.ContextVar("loss_scaling")
# Outside a schedule: weight T, for a training loss summed over the tokens (a layer tested on its own).
_OUTSIDE_A_SCHEDULE = LossScaling()


@contextlib.contextmanager
def scaled_loss(scaling: LossScaling):
    """Forwards run inside weigh the losses their layers attach by `scaling`."""
    token = _SCALING.set(scaling)
    try:
        yield
    finally:
        _SCALING.reset(token)


def auxiliary_loss_weight(num_tokens: int) -> float:
    """The weight of a loss that a layer attaches in the forward being run (see LossScaling)."""
    return _SCALING.get(_OUTSIDE_A_SCHEDULE).auxiliary_loss_weight(num_tokens)
