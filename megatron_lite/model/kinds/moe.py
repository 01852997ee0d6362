"""The MoE layer (model/moe/layer.py): a router, routed experts and an optional shared expert.

Saved per micro-batch: the router's fp32 input, logits and scores (4 E) and top-k probabilities and indices on the
rank's own tokens; for k copies of each token of the expert region, the routed experts' input e h, fc1 output,
activation and product (ffn / etp wide; ETP: --expert-tensor-parallel-size), their output and its
probability-weighted copy e 2h, the probability and three int64 indices; the region is the ETP group's tokens (s/tp
each, gathered) where its ranks hold different ones, else the rank's s; a shared expert's input (a tensor of its own
under sequence parallelism or bf16/fp16), fc1 output, activation and product on s tokens, ffn / tp wide, and its
gate's output. With --moe-latent-size L the routed experts' rows are L wide instead of h, and the two latent
projections keep their inputs: the layer's input e h on the rank's tokens (where no other tensor is it: the router's
fp32 copy in fp32, the shared expert's input without sequence parallelism) and the combined output e L.
"""

from __future__ import annotations

from megatron_lite.config.layer_specs import LayerSpec
from megatron_lite.config.sections import Config, ModelConfig
from megatron_lite.model.kinds.activation_terms import (
    FP32,
    INDEX,
    expert_region_tokens,
    expert_tensor_parallel_size,
    micro_batch_tokens,
    param_bytes,
)
from megatron_lite.model.kinds.kind import Kind
from megatron_lite.model.moe.layer import MoELayer


def build(config, pstate, number, spec, parts):
    return MoELayer(config, pstate, number, sequence_parallel=parts.sequence_parallel,
                    token_dispatcher=config.moe_token_dispatcher_type)


def flops(config: ModelConfig, spec: LayerSpec) -> float:
    """The top-k experts a token visits (at the latent width with --moe-latent-size, and the two projections to it
    and back), the router, and the shared expert and its gate."""
    h, matrices = config.hidden_size, 3 if config.gated_linear_unit else 2
    width = config.moe_latent_size or h
    weights = config.moe_router_topk * matrices * width * config.moe_ffn_hidden_size + h * config.num_experts
    weights += 2 * h * config.moe_latent_size if config.moe_latent_size else 0
    if config.moe_shared_expert_intermediate_size:
        weights += matrices * h * config.moe_shared_expert_intermediate_size + h * config.moe_shared_expert_gate
    return 2 * weights


def moe_mlp_bytes(config: Config) -> int:
    """Bytes one micro-batch saves in an MoE layer's MLP (module docstring), for softmax routing with a balancing
    loss (other router settings save other [tokens, E] fp32 tensors)."""
    m, p = config.model, config.parallel
    e, h, k = param_bytes(config), m.hidden_size, m.moe_router_topk
    tokens, stream = micro_batch_tokens(config)
    widths = 4 if m.gated_linear_unit else 2
    width = m.moe_latent_size or h  # of the routed experts' rows
    router = FP32 * (h + 2 * m.num_experts + 1) + k * (FP32 + INDEX)  # this rank's tokens (s/tp under SP)
    experts = e * (3 * width + widths * (m.moe_ffn_hidden_size // expert_tensor_parallel_size(config)) + 1) + 3 * INDEX
    total = stream * router + expert_region_tokens(config) * k * experts
    shared = m.moe_shared_expert_intermediate_size
    if m.moe_latent_size:
        input_saved_elsewhere = e == FP32 or (shared and not p.sequence_parallel)
        total += stream * (e * m.moe_latent_size + (0 if input_saved_elsewhere else e * h))
    if shared:  # on every local token: its input (the router's fp32 one without SP, in fp32), fc1 and activation
        own_input = p.sequence_parallel or e != FP32
        gate = e * (h + 1) if m.moe_shared_expert_gate else 0  # its output and the gate's sigmoid
        total += tokens * (e * (h * own_input + widths * (shared // p.tensor_model_parallel_size)) + gate)
    return total


def saved_bytes(config: Config, spec: LayerSpec) -> int:
    return moe_mlp_bytes(config)


KIND = Kind(build, flops, saved_bytes)
