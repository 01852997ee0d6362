"""The modules of each kind of layer part, by the names of config/layer_specs.py: a transformer layer builds its
token mixer and its MLP from these tables, so a new kind is a module and an entry here."""

from __future__ import annotations

from typing import NamedTuple

from megatron_lite.config.layer_specs import ATTENTION, DENSE, GATED_DELTA_NET, LATENT_ATTENTION, MOE
from megatron_lite.model.attention.mla import MultiLatentAttention
from megatron_lite.model.attention.self_attention import SelfAttention
from megatron_lite.model.linear_attention.gated_delta_net import GatedDeltaNet
from megatron_lite.model.mlp import MLP
from megatron_lite.model.moe.layer import MoELayer


class LayerParts(NamedTuple):
    """What every part of one transformer layer is built with besides the model's configuration."""

    sequence_parallel: bool
    backend: str  # the attention kernels (model/attention/self_attention.py choose_attention_backend)
    rng_tracker: object
    cp_comm_type: str
    fp8: object  # the layer's FP8Recipe, or None


def _attention(config, pstate, number, spec, parts):
    return SelfAttention(config, pstate, sequence_parallel=parts.sequence_parallel, backend=parts.backend,
                         rng_tracker=parts.rng_tracker, cp_comm_type=parts.cp_comm_type, fp8=parts.fp8,
                         window=spec.window)


def _latent_attention(config, pstate, number, spec, parts):
    return MultiLatentAttention(config, pstate, sequence_parallel=parts.sequence_parallel, backend=parts.backend,
                                rng_tracker=parts.rng_tracker, cp_comm_type=parts.cp_comm_type, fp8=parts.fp8)


def _gated_delta_net(config, pstate, number, spec, parts):
    return GatedDeltaNet(config, pstate, sequence_parallel=parts.sequence_parallel)


def _dense(config, pstate, number, spec, parts):
    return MLP(config, pstate, sequence_parallel=parts.sequence_parallel, fp8=parts.fp8)


def _moe(config, pstate, number, spec, parts):
    return MoELayer(config, pstate, number, sequence_parallel=parts.sequence_parallel,
                    token_dispatcher=config.moe_token_dispatcher_type)


# kind -> build(model config, parallel state, global layer number, LayerSpec, the layer's shared parts)
MIXERS = {ATTENTION: _attention, LATENT_ATTENTION: _latent_attention, GATED_DELTA_NET: _gated_delta_net}
MLPS = {DENSE: _dense, MOE: _moe}
