"""DeepSeek-V3 (transformers' deepseek_v3; Moonlight and Kimi K2 too): its config.json <-> megatron_lite model
flags, the network it recognises and its name table.

Multi-latent attention with its latent norms (--qk-layernorm) and YaRN (rope_type "yarn"), first_k_dense_replace
dense layers (--moe-layer-freq), then sigmoid-routed experts with an expert bias (e_score_correction_bias),
group-limited, renormalized over the top k and scaled by routed_scaling_factor, n_shared_experts shared experts
as one shared MLP, and num_nextn_predict_layers multi-token prediction modules (stored as the layers after the
decoder's). Its latent norms take rms_norm_eps (Megatron's choice), where transformers fixes 1e-6 (DeepSeek-V3's
rms_norm_eps; Moonlight's 1e-5 moves the logits by about 1e-6 of their scale).
"""

from __future__ import annotations

from megatron_lite.config.layer_pattern import moe_layer_pattern
from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse, required
from megatron_lite.hf.families.family import Family, refuse_network
from megatron_lite.hf.families.gpt_oss import gpt_oss_options
from megatron_lite.hf.llama_config import llama_config, llama_values, yarn_values
from megatron_lite.hf.name_tables import VOCAB_ROWS, NameTable, Rule, llama_names, swiglu_mlp
from megatron_lite.model.attention.yarn import YarnScaling, yarn_mscale


def _values(hf: dict) -> dict:
    refuse(not hf.get("rope_interleave", True), "a deepseek_v3 without rope_interleave")
    refuse(not hf.get("norm_topk_prob", True), "a deepseek_v3 without norm_topk_prob")
    refuse(hf.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func {hf.get('scoring_func')!r}")
    layers, dense = required(hf, "num_hidden_layers"), hf.get("first_k_dense_replace", 0)
    groups, group_topk, topk = hf.get("n_group") or 1, hf.get("topk_group") or 1, required(hf, "num_experts_per_tok")
    refuse(groups > 1 and topk != 2 * group_topk, f"group-limited routing that ranks groups by their top 2 scores "
                                                   f"with num_experts_per_tok ({topk}) other than 2 x topk_group "
                                                   f"({group_topk})")
    values = {**llama_values({**hf, "head_dim": None, "num_key_value_heads": None, "rope_parameters": None,
                               "rope_scaling": None}), **yarn_values(hf)}
    shared = (hf.get("n_shared_experts") or 0) * required(hf, "moe_intermediate_size")
    refuse(not shared, "a deepseek_v3 without shared experts (n_shared_experts)")
    values.update(
        group_query_attention=False, num_query_groups=None, kv_channels=None, multi_latent_attention=True,
        qk_layernorm=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=required(hf, "kv_lora_rank"),
        qk_head_dim=required(hf, "qk_nope_head_dim"), qk_pos_emb_head_dim=required(hf, "qk_rope_head_dim"),
        v_head_dim=required(hf, "v_head_dim"), num_experts=required(hf, "n_routed_experts"), moe_router_topk=topk,
        moe_ffn_hidden_size=required(hf, "moe_intermediate_size"), moe_layer_freq=f"([0]*{dense}+[1]*{layers - dense})",
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
        moe_shared_expert_intermediate_size=shared, mtp_num_layers=hf.get("num_nextn_predict_layers") or None)
    return values


def _recognises(m: ModelConfig) -> bool:
    """A network with multi-latent attention is DeepSeek-V3's or no family's."""
    if not m.multi_latent_attention:
        return False
    pattern = moe_layer_pattern(m)
    dense = pattern.index(True) if True in pattern else len(pattern)
    refuse_network("deepseek_v3", "multi-latent attention", [
        (m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope", "RMSNorm, SwiGLU and RoPE"),
        (m.qk_layernorm, "--qk-layernorm (its latent norms)"),
        (not m.apply_layernorm_1p, "norms without --apply-layernorm-1p"),
        (not gpt_oss_options(m), f"none of {', '.join(gpt_oss_options(m))}"),
        (bool(m.num_experts) and all(pattern[dense:]), "experts in every layer after the first dense ones"),
        (m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias, "sigmoid routing with "
         "--moe-router-enable-expert-bias"),
        (m.moe_router_group_topk is None or m.moe_router_topk == 2 * m.moe_router_group_topk,
         "--moe-router-topk twice --moe-router-group-topk (groups ranked by their top 2 scores)"),
        (bool(m.moe_shared_expert_intermediate_size) and not m.moe_shared_expert_gate
         and (m.moe_shared_expert_intermediate_size or 1) % m.moe_ffn_hidden_size == 0,
         "an ungated shared expert whose size is a multiple of --moe-ffn-hidden-size")])
    return True


def _config(m: ModelConfig) -> dict:
    config = llama_config(m)
    for key in ("mlp_bias", "head_dim", "num_key_value_heads", "rope_scaling"):
        del config[key]
    yarn = YarnScaling.of(m)
    rope = {"rope_type": "default", "rope_theta": m.rotary_base}
    if m.rotary_scaling_factor != 1.0:
        rope = {"rope_type": "yarn", "rope_theta": m.rotary_base, "factor": m.rotary_scaling_factor,
                "original_max_position_embeddings": m.yarn_original_max_position_embeddings,
                "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow, "mscale": m.mscale,
                "mscale_all_dim": m.mscale_all_dim}
        inferred = yarn_mscale(m.rotary_scaling_factor, 1.0) if not (m.mscale and m.mscale_all_dim) else None
        if inferred is not None and inferred != yarn.attention_factor:  # what transformers takes without the key
            rope["attention_factor"] = yarn.attention_factor
        if not m.yarn_correction_range_round_to_int:
            rope["truncate"] = False
    pattern = moe_layer_pattern(m)
    return {**config, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "rope_parameters": rope,
            "rope_interleave": True, "q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_head_dim, "qk_rope_head_dim": m.qk_pos_emb_head_dim, "v_head_dim": m.v_head_dim,
            "moe_intermediate_size": m.moe_ffn_hidden_size, "n_routed_experts": m.num_experts,
            "n_shared_experts": m.moe_shared_expert_intermediate_size // m.moe_ffn_hidden_size,
            "num_experts_per_tok": m.moe_router_topk, "first_k_dense_replace": pattern.index(True),
            "n_group": m.moe_router_num_groups or 1, "topk_group": m.moe_router_group_topk or 1,
            "norm_topk_prob": True, "routed_scaling_factor": m.moe_router_topk_scaling_factor or 1.0,
            **({"num_nextn_predict_layers": m.mtp_num_layers} if m.mtp_num_layers else {})}


def _latent_attention(m: ModelConfig) -> list[Rule]:
    """Norms and multi-latent attention of a layer (model/attention/mla.py's names; HF's in the same layouts)."""
    ours, attn = "decoder.layers.{layer}.", "model.layers.{layer}.self_attn."
    heads, q_dim = m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim

    def rule(our_name, their_name, shape):
        return Rule(f"{ours}{our_name}", (f"{attn}{their_name}",), lambda m: (shape,))

    rules = [Rule(ours + "input_layernorm.weight", ("model.layers.{layer}.input_layernorm.weight",),
                  lambda m: ((m.hidden_size,),)),
             Rule(ours + "pre_mlp_layernorm.weight", ("model.layers.{layer}.post_attention_layernorm.weight",),
                  lambda m: ((m.hidden_size,),))]
    if m.q_lora_rank is None:
        rules.append(rule("self_attention.linear_q_proj.weight", "q_proj.weight", (heads * q_dim, m.hidden_size)))
    else:
        rules += [rule("self_attention.linear_q_down_proj.weight", "q_a_proj.weight", (m.q_lora_rank, m.hidden_size)),
                  rule("self_attention.q_layernorm.weight", "q_a_layernorm.weight", (m.q_lora_rank,)),
                  rule("self_attention.linear_q_up_proj.weight", "q_b_proj.weight", (heads * q_dim, m.q_lora_rank))]
    return rules + [
        rule("self_attention.linear_kv_down_proj.weight", "kv_a_proj_with_mqa.weight",
             (m.kv_lora_rank + m.qk_pos_emb_head_dim, m.hidden_size)),
        rule("self_attention.kv_layernorm.weight", "kv_a_layernorm.weight", (m.kv_lora_rank,)),
        rule("self_attention.linear_kv_up_proj.weight", "kv_b_proj.weight",
             (heads * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank)),
        rule("self_attention.linear_proj.weight", "o_proj.weight", (m.hidden_size, heads * m.v_head_dim))]


def _mtp(m: ModelConfig) -> list[Rule]:
    """The multi-token prediction module as published (layer num_hidden_layers + depth): its norms, the 2h -> h
    projection and the final norm (shared_head.norm), and copies of the embedding and output layer that the module
    shares with the model (embed_tokens, shared_head.head), read back as the model's own tables."""
    ours, theirs = "mtp.layers.{depth}.", "model.layers.{layer}."
    head = "output_layer.weight" if m.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
    h = m.hidden_size
    return [Rule("embedding.word_embeddings.weight", (theirs + "embed_tokens.weight",),
                 lambda m: ((m.vocab_size, h),), VOCAB_ROWS),
            Rule(ours + "enorm.weight", (theirs + "enorm.weight",), lambda m: ((h,),)),
            Rule(ours + "hnorm.weight", (theirs + "hnorm.weight",), lambda m: ((h,),)),
            Rule(ours + "eh_proj.weight", (theirs + "eh_proj.weight",), lambda m: ((h, 2 * h),)),
            Rule(ours + "final_layernorm.weight", (theirs + "shared_head.norm.weight",), lambda m: ((h,),)),
            Rule(head, (theirs + "shared_head.head.weight",), lambda m: ((m.vocab_size, h),), VOCAB_ROWS)]


def _name_table(m: ModelConfig) -> NameTable:
    """Multi-latent attention; dense SwiGLU MLPs in the first layers, then a sigmoid router with its expert bias,
    routed experts and a shared expert."""
    ours, theirs = "decoder.layers.{layer}.mlp.", "model.layers.{layer}.mlp."
    moe = [Rule(ours + "router.weight", (theirs + "gate.weight",), lambda m: ((m.num_experts, m.hidden_size),)),
           Rule(ours + "router.expert_bias", (theirs + "gate.e_score_correction_bias",), lambda m: ((m.num_experts,),)),
           *swiglu_mlp(ours + "experts.{expert}.", theirs + "experts.{expert}.", lambda m: m.moe_ffn_hidden_size),
           *swiglu_mlp(ours + "shared_experts.", theirs + "shared_experts.",
                       lambda m: m.moe_shared_expert_intermediate_size)]
    dense = swiglu_mlp(ours, theirs, lambda m: m.ffn_hidden_size)
    attention = _latent_attention(m)
    return llama_names(m, lambda spec: attention + (moe if spec.routed_experts else dense), mtp=_mtp(m))


DEEPSEEK_V3 = Family("deepseek_v3", _values, _config, _recognises, _name_table)
