"""The MLP of a layer whose mixer stands alone (a Mamba-2 mixer with no MLP after it): nothing is built, costs
nothing, and the layer gives it no pre-norm."""

from __future__ import annotations

from megatron_lite.model.kinds.kind import Kind

KIND = Kind(build=lambda *args: None, flops=lambda config, spec: 0, saved_bytes=lambda config, spec: 0, normed=False)
