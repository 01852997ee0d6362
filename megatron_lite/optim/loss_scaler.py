"""Loss scaling for fp16 training: keep small gradients representable, skip steps whose gradients overflow.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The schedule multiplies the loss by the
scale before backward and the optimizer divides the gradients by it; a step whose gradients hold an inf
or a NaN on any rank is skipped. Megatron's dynamic scaler, with its defaults: start at 2^32, halve after
`hysteresis` (2) overflows, never below `min_scale` (1), double after `growth_interval` (1000) steps in a
row without overflow (which also restores the hysteresis budget). bf16 has fp32's exponent range and
needs no scaling.
"""

from __future__ import annotations

from megatron_lite.config.sections import OptimizerConfig


class ConstantGradScaler:
    """A fixed loss scale (--loss-scale); steps with overflowing gradients are still skipped."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    """Megatron's DynamicGradScaler: back off on overflow (with hysteresis), grow after a clean window."""

    def __init__(self, initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0  # steps in a row without overflow
        self.hysteresis_tracker = hysteresis  # overflows left before the scale is lowered

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


def build_grad_scaler(config: OptimizerConfig) -> ConstantGradScaler | DynamicGradScaler | None:
    """fp16 only: --loss-scale fixes the scale, otherwise it is dynamic from --initial-loss-scale."""
    if not config.fp16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                             growth_interval=config.loss_scale_window, hysteresis=config.hysteresis)
