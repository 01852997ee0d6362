"""Every kind of token mixer and MLP, one module each, by the names of config/layer_specs.py: a transformer layer
builds its parts from these tables, the planner counts their saved bytes and the MFU their FLOPs (kind.py says what
each entry supplies). A new kind is its module and its entry here."""

from __future__ import annotations

from megatron_lite.config.layer_specs import ATTENTION, DENSE, GATED_DELTA_NET, LATENT_ATTENTION, MOE
from megatron_lite.model.kinds import dense_mlp, gated_delta_net, latent_attention, moe, softmax_attention
from megatron_lite.model.kinds.kind import Kind, LayerParts

MIXERS: dict[str, Kind] = {ATTENTION: softmax_attention.KIND, LATENT_ATTENTION: latent_attention.KIND,
                           GATED_DELTA_NET: gated_delta_net.KIND}
MLPS: dict[str, Kind] = {DENSE: dense_mlp.KIND, MOE: moe.KIND}

__all__ = ["MIXERS", "MLPS", "Kind", "LayerParts"]
