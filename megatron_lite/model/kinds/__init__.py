"""Every kind of token mixer and MLP, one module each, by the names of config/layer_specs.py: a transformer layer
builds its parts from these tables, the planner counts their saved bytes and the MFU their FLOPs (kind.py says what
each entry supplies). A new kind is its module and its entry here."""

from __future__ import annotations

from megatron_lite.config.layer_specs import ATTENTION, DENSE, GATED_DELTA_NET, LATENT_ATTENTION, MAMBA, MOE, NO_MLP
from megatron_lite.model.kinds import dense_mlp, gated_delta_net, latent_attention, mamba, moe, softmax_attention
from megatron_lite.model.kinds.kind import Kind, LayerParts

_ABSENT = Kind(build=lambda *args: None, flops=lambda config, spec: 0, saved_bytes=lambda config, spec: 0,
               normed=False)  # the MLP of a layer that has a mixer alone

MIXERS: dict[str, Kind] = {ATTENTION: softmax_attention.KIND, LATENT_ATTENTION: latent_attention.KIND,
                           GATED_DELTA_NET: gated_delta_net.KIND, MAMBA: mamba.KIND}
MLPS: dict[str, Kind] = {DENSE: dense_mlp.KIND, MOE: moe.KIND, NO_MLP: _ABSENT}

__all__ = ["MIXERS", "MLPS", "Kind", "LayerParts"]
