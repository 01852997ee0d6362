"""The factor the loss path multiplies the language-model loss by, for losses that layers attach themselves.

With fp16 loss scaling the schedule backpropagates loss x scale; a layer that feeds a loss of its own into
the backward pass (the MoE balancing losses, model/moe_router.MoEAuxLossAutoScaler) must scale it alike.
The schedule runs each forward inside `scaled_loss(scale)`, as torch.autocast scopes a dtype, and a layer
reads `current_loss_scale()` during its forward, so no built module is changed from outside.
"""

from __future__ import annotations

import contextlib
import contextvars

_LOSS_SCALE = contextvars.ContextVar("loss_scale", default=1.0)


@contextlib.contextmanager
def scaled_loss(scale: float):
    """Forwards run inside have their losses multiplied by `scale` before the backward pass."""
    token = _LOSS_SCALE.set(scale)
    try:
        yield
    finally:
        _LOSS_SCALE.reset(token)


def current_loss_scale() -> float:
    """The loss scale of the forward being run (1 outside `scaled_loss`)."""
    return _LOSS_SCALE.get()
