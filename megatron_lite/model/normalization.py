"""The norm every norm module of the model computes: LayerNorm or RMSNorm, with Megatron's zero-centred weights.

With --apply-layernorm-1p (Megatron's layernorm_zero_centered_gamma, Qwen3-Next's norms) a norm's weight is
stored as w and applied as 1 + w: it starts at 0, so weight decay pulls the scale toward 1 rather than 0.
RMSNorm computes in fp32 and rounds once to the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_norm(x: torch.Tensor, kind: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               zero_centered: bool) -> torch.Tensor:
    """`kind` ("RMSNorm" or "LayerNorm") of x over its last dimension, scaled by weight (1 + weight when
    `zero_centered`) and shifted by bias (LayerNorm)."""
    if kind == "RMSNorm":
        scale = weight.float() + 1 if zero_centered else weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight + 1 if zero_centered else weight, bias, eps)
