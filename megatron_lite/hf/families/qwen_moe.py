"""Qwen3-MoE and Qwen2-MoE (transformers' qwen3_moe, qwen2_moe): Qwen3's or Qwen2's attention with experts in every
layer, routed with a softmax over all experts, renormalized over the top k (as Mixtral) with norm_topk_prob, as
they are without (--moe-router-pre-softmax); Qwen2-MoE adds a gated shared expert
(--moe-shared-expert-intermediate-size, --moe-shared-expert-gate). Dense layers among the MoE ones are refused."""

from __future__ import annotations

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse, required
from megatron_lite.hf.families.family import Family
from megatron_lite.hf.families.llama import moe_llama
from megatron_lite.hf.families.qwen import qwen_config
from megatron_lite.hf.llama_config import llama_values
from megatron_lite.hf.name_tables import NameTable, Rule, llama_attention, llama_names, swiglu_mlp


def _values(hf: dict) -> dict:
    refuse(hf.get("decoder_sparse_step", 1) != 1 or bool(hf.get("mlp_only_layers")),
           "a qwen MoE with dense layers (decoder_sparse_step, mlp_only_layers)")
    refuse(bool(hf.get("use_sliding_window")), f"sliding-window attention ({hf.get('sliding_window')})")
    values = {**llama_values({**hf, "attention_bias": False}), "qk_layernorm": hf["model_type"] == "qwen3_moe"}
    refuse(hf["model_type"] == "qwen3_moe" and bool(hf.get("attention_bias")), "a qwen3_moe with attention biases")
    num_experts = hf.get("num_experts") or required(hf, "num_local_experts")
    values.update(num_experts=num_experts, moe_router_topk=required(hf, "num_experts_per_tok"),
                  moe_ffn_hidden_size=required(hf, "moe_intermediate_size"),
                  moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                  moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    if hf["model_type"] == "qwen2_moe":
        values.update(add_qkv_bias=bool(hf.get("qkv_bias", True)),
                      moe_shared_expert_intermediate_size=required(hf, "shared_expert_intermediate_size"),
                      moe_shared_expert_gate=True)
    return values


def _config(m: ModelConfig, model_type: str, architecture: str) -> dict:
    config = {**qwen_config(m, "qwen2" if model_type == "qwen2_moe" else "qwen3", architecture),
              "model_type": model_type, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "moe_intermediate_size": m.moe_ffn_hidden_size, "num_experts": m.num_experts,
              "num_experts_per_tok": m.moe_router_topk, "norm_topk_prob": not m.moe_router_pre_softmax,
              "router_aux_loss_coef": m.moe_aux_loss_coeff}
    del config["sliding_window"]  # unused with use_sliding_window off; the versions' defaults differ
    if model_type == "qwen3_moe":
        return {**config, "num_local_experts": m.num_experts}  # transformers 5's name; older ones read num_experts
    return {**config, "qkv_bias": m.add_qkv_bias,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size}


def qwen_moe_mlp(m: ModelConfig) -> list[Rule]:
    """A Qwen MoE layer's router (gate) and experts gate/up/down_proj, and the shared expert with its sigmoid gate
    where the model has one."""
    ours, theirs = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
    mlp = [Rule(ours + "router.weight", (theirs + "gate.weight",), lambda m: ((m.num_experts, m.hidden_size),)),
           *swiglu_mlp(ours + "experts.{expert}.", theirs + "experts.{expert}.", lambda m: m.moe_ffn_hidden_size)]
    if m.moe_shared_expert_intermediate_size:
        mlp += [*swiglu_mlp(ours + "shared_experts.", theirs + "shared_expert.",
                            lambda m: m.moe_shared_expert_intermediate_size),
                Rule(ours + "shared_experts.gate_weight", (theirs + "shared_expert_gate.weight",),
                     lambda m: ((1, m.hidden_size),))]
    return mlp


def _name_table(m: ModelConfig) -> NameTable:
    """A router and experts in every layer, and Qwen2-MoE's gated shared expert."""
    layer = llama_attention(m) + qwen_moe_mlp(m)
    return llama_names(m, lambda spec: layer)


QWEN3_MOE = Family("qwen3_moe", _values, lambda m: _config(m, "qwen3_moe", "Qwen3MoeForCausalLM"),
                   lambda m: (moe_llama(m) and not m.moe_shared_expert_intermediate_size and m.qk_layernorm
                              and not m.add_qkv_bias), _name_table)
QWEN2_MOE = Family("qwen2_moe", _values, lambda m: _config(m, "qwen2_moe", "Qwen2MoeForCausalLM"),
                   lambda m: (moe_llama(m) and bool(m.moe_shared_expert_intermediate_size)
                              and m.moe_shared_expert_gate and not m.qk_layernorm), _name_table)
