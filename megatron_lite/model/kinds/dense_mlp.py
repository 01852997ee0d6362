"""The dense MLP (model/mlp.py): fc1, GELU or SwiGLU, fc2.

Saved per token, with e the bytes of an activation and tp-local widths: fc1's input e h (the whole sequence under
sequence parallelism: the linear saves the all-gathered input), its output e c ffn (c = 2 for SwiGLU), the
activation's output e ffn, and SwiGLU's product e ffn.
"""

from __future__ import annotations

from megatron_lite.config.layer_specs import LayerSpec
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.model.kinds.activation_terms import micro_batch_tokens, param_bytes
from megatron_lite.model.kinds.kind import Kind
from megatron_lite.model.mlp import MLP


def build(config, pstate, number, spec, parts):
    return MLP(config, pstate, sequence_parallel=parts.sequence_parallel, fp8=parts.fp8)


def flops(config: ModelConfig, spec: LayerSpec) -> float:
    return 2 * (3 if config.gated_linear_unit else 2) * config.hidden_size * config.ffn_hidden_size


def saved_bytes(config: Config, spec: LayerSpec) -> int:
    """fc1's input and output (2 ffn wide gated), the activation's output and the product."""
    m, tp = config.model, config.parallel.tensor_model_parallel_size
    widths = 4 if m.gated_linear_unit else 2
    return micro_batch_tokens(config)[0] * param_bytes(config) * (m.hidden_size + m.ffn_hidden_size // tp * widths)


KIND = Kind(build, flops, saved_bytes)
