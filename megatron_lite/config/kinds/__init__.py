"""Every kind of token mixer and MLP, listed once: the configuration reads its name, pattern symbol, flags and
checks here (config/kinds/kind.py), the model its build, FLOPs and saved bytes from the module each names.

Softmax attention, multi-latent attention, Gated DeltaNet, the dense MLP and the MoE layer are described by flags
of their own as well (--multi-latent-attention, --linear-attention-freq, --moe-layer-freq, ...), which the pattern
sets (config/hybrid_layer_pattern.py); a kind added since is placed by the pattern alone and brings its flags and
checks in its module here.
"""

from __future__ import annotations

from megatron_lite.config.kinds import mamba
from megatron_lite.config.kinds.kind import ConfigKind

ATTENTION = ConfigKind("attention", "mixer", "megatron_lite.model.kinds.softmax_attention", symbol="*",
                       described="softmax attention")
LATENT_ATTENTION = ConfigKind("multi-latent attention", "mixer", "megatron_lite.model.kinds.latent_attention",
                              symbol="+", described="multi-latent attention")
GATED_DELTA_NET = ConfigKind("Gated DeltaNet", "mixer", "megatron_lite.model.kinds.gated_delta_net", symbol="G",
                             described="Gated DeltaNet")
DENSE = ConfigKind("dense", "mlp", "megatron_lite.model.kinds.dense_mlp", symbol="-", described="a dense MLP")
MOE = ConfigKind("MoE", "mlp", "megatron_lite.model.kinds.moe", symbol="E", described="an MoE layer")
NO_MLP = ConfigKind("none", "mlp", "megatron_lite.model.kinds.absent")  # the MLP of a mixer alone

KINDS: tuple[ConfigKind, ...] = (ATTENTION, LATENT_ATTENTION, GATED_DELTA_NET, mamba.KIND, DENSE, MOE, NO_MLP)
BY_SYMBOL = {kind.symbol: kind for kind in KINDS if kind.symbol is not None}
SECTIONS = tuple(kind.section for kind in KINDS if kind.section is not None)
