"""The model FLOPs of one trained token: the numerator of MFU, shared by the training log and the planner."""

from __future__ import annotations

from megatron_lite.config.layer_specs import numbered_layer_specs
from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.kinds import MIXERS, MLPS


def training_flops_per_token(config: ModelConfig) -> float:
    """Model FLOPs to train on one token, counting matrix multiplies only (as PaLM's MFU, appendix B).

    Forward: 2 FLOPs per weight of every linear layer (QKV and the output gate's rows, attention output, MLP or
    the top-k experts a token visits and the shared expert, output layer) plus the attention scores and weighted sum,
    2 * 2 * seq * hidden per layer (the full square, as Megatron counts it; heads x head size stands for
    hidden where --kv-channels sets another head size; a layer with --window-size LEFT 0 counts the LEFT + 1 keys
    a query may see, where fewer than seq); each kind's own count is its module's `flops` (model/kinds/), summed
    over the layer specs (config/layer_specs.py). Each multi-token prediction depth adds its 2h -> h projection, a
    layer of the last decoder layer's kind and the output layer. Backward costs twice
    the forward. Activation recomputation is not counted: it is work the hardware does, not work the model
    needs, so MFU stays comparable between runs with and without it.
    """
    h = config.hidden_size
    forward = sum(MIXERS[spec.mixer].flops(config, spec) + MLPS[spec.mlp].flops(config, spec)
                  for spec in numbered_layer_specs(config))
    forward += 2 * (config.mtp_num_layers or 0) * 2 * h * h  # each depth's 2h -> h projection
    forward += 2 * (1 + (config.mtp_num_layers or 0)) * h * config.vocab_size  # the output layer, once per depth too
    return forward * 3
