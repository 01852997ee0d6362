"""The model flags of Mixture-of-Experts layers (model/moe/), with Megatron-Core's names: a section of ModelConfig
kept in a file of its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MoEConfig:
    num_experts: int | None = None
    """routed experts per MoE layer; unset: dense MLPs"""
    moe_router_topk: int = 2
    """experts each token is routed to"""
    moe_ffn_hidden_size: int | None = None
    """inner width of each expert's MLP; default: ffn-hidden-size"""
    moe_aux_loss_coeff: float = 0.0
    """weight of the load-balancing auxiliary loss (Switch Transformer's)"""
    moe_z_loss_coeff: float = 0.0
    """weight of the router z-loss (ST-MoE's), which keeps the router's logits small"""
    moe_expert_capacity_factor: float | None = None
    """each expert takes at most factor x tokens x topk / experts tokens, the rest dropped; unset: dropless"""
    moe_layer_freq: str | int | list[int] = 1
    """N: every N-th layer is an MoE layer, from the first; or one 0 (dense) / 1 (MoE) per layer as a list expression
    such as ([0]*3+[1]*58) (config/layer_pattern.py)"""
    moe_token_dispatcher_type: str = "alltoall"
    """how tokens reach the experts of other expert-parallel ranks: alltoall sends each token where it goes, allgather
    gathers every token everywhere"""
    moe_router_pre_softmax: bool = False
    """softmax over all experts before the top-k (Mixtral normalizes over the chosen k after it)"""
    moe_router_score_function: str = "softmax"
    """softmax (over the top-k logits, or over all experts with --moe-router-pre-softmax) or sigmoid (each expert
    scored on its own, the k chosen scores divided by their sum, as DeepSeek-V3)"""
    moe_router_topk_scaling_factor: float | None = None
    """the k routing probabilities multiplied by this (DeepSeek-V3: 2.5); unset: 1"""
    moe_router_load_balancing_type: str = "aux_loss"
    """the balancing loss weighted by --moe-aux-loss-coeff: aux_loss over each micro-batch, seq_aux_loss over each
    sequence (DeepSeek-V2/V3), or none"""
    moe_router_enable_expert_bias: bool = False
    """aux-loss-free load balancing: a per-expert bias added to the sigmoid scores for choosing experts only, moved
    each iteration by --moe-router-bias-update-rate towards the experts the global batch used least; identical on
    every rank and saved in checkpoints"""
    moe_router_bias_update_rate: float = 1e-3
    """with --moe-router-enable-expert-bias: how far each bias moves per iteration"""
    moe_router_num_groups: int | None = None
    """group-limited routing (DeepSeek-V3): the experts form this many groups of consecutive experts, groups are
    ranked by the sum of their top k / group-topk scores, and each token chooses among the experts of its
    --moe-router-group-topk best groups"""
    moe_router_group_topk: int | None = None
    """with --moe-router-num-groups: how many groups each token may use"""
    moe_shared_expert_intermediate_size: int | None = None
    """inner width of a shared expert that every token runs beside its routed experts; unset: none"""
    moe_shared_expert_gate: bool = False
    """the shared expert's output scaled by sigmoid(x w_gate), as Qwen2-MoE"""
    moe_latent_size: int | None = None
    """the routed experts work in a latent of this width: the tokens projected down to it before dispatch and the
    experts' combined output back up after (Nemotron 3 Super); the router and the shared expert see the hidden
    state; unset: the experts work at hidden-size"""
