"""Mixtral (transformers' mixtral): a Llama with experts in every layer, routed by a softmax over all experts
renormalized over the top k, its head size the hidden size over the heads; its sliding window is refused where it
is shorter than the context."""

from __future__ import annotations

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse, required
from megatron_lite.hf.families.family import Family
from megatron_lite.hf.families.llama import moe_llama, plain_attention
from megatron_lite.hf.llama_config import llama_config, llama_values
from megatron_lite.hf.name_tables import NameTable, Rule, llama_attention, llama_names, swiglu_mlp


def _values(hf: dict) -> dict:
    window = hf.get("sliding_window")
    refuse(window is not None and window < required(hf, "max_position_embeddings"),
           f"sliding-window attention ({window})")
    values = llama_values(hf)
    refuse(values["kv_channels"] is not None, f"a mixtral head_dim ({hf.get('head_dim')}) other than hidden_size / "
                                               f"num_attention_heads")
    return {**values, "num_experts": required(hf, "num_local_experts"),
            "moe_router_topk": required(hf, "num_experts_per_tok"),
            "moe_ffn_hidden_size": required(hf, "intermediate_size"),
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef", 0.0))}


def _config(m: ModelConfig) -> dict:
    config = llama_config(m)
    for key in ("attention_bias", "mlp_bias", "head_dim"):  # MixtralConfig derives head_dim from the hidden size
        del config[key]
    return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": m.moe_ffn_hidden_size, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "sliding_window": None}


def _recognises(m: ModelConfig) -> bool:
    return (moe_llama(m) and not m.moe_shared_expert_intermediate_size and not m.moe_router_pre_softmax
            and plain_attention(m) and m.kv_channels in (None, m.hidden_size // m.num_attention_heads))


def _name_table(m: ModelConfig) -> NameTable:
    """A router and experts w1 (gate), w3 (up), w2 (down) in every layer."""
    moe = "model.layers.{layer}.block_sparse_moe."
    layer = llama_attention(m) + [
        Rule("decoder.layers.{layer}.mlp.router.weight", (moe + "gate.weight",),
             lambda m: ((m.num_experts, m.hidden_size),)),
        *swiglu_mlp("decoder.layers.{layer}.mlp.experts.{expert}.", moe + "experts.{expert}.",
                    lambda m: m.moe_ffn_hidden_size, names=("w1", "w3", "w2"))]
    return llama_names(m, lambda spec: layer)


MIXTRAL = Family("mixtral", _values, _config, _recognises, _name_table)
