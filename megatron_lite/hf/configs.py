"""Hugging Face config.json <-> megatron_lite model flags, for the llama, qwen2, qwen3, gpt2, mixtral, qwen3_moe,
qwen2_moe, deepseek_v3, qwen3_next, qwen3_5 (text) and gpt_oss families (gpt-oss's own mapping in gpt_oss.py, what
Llama-derived families share in llama_config.py).

A config.json becomes the values of pretrain_gpt.py's model flags (ModelConfig field names); a ModelConfig
becomes a config.json that `transformers.AutoModelForCausalLM.from_pretrained` reads. Qwen2 is a Llama with a
QKV bias (--add-qkv-bias), Qwen3 one with per-head q/k norms (--qk-layernorm); their MoE versions route with a
softmax over all experts, renormalized over the top k (as Mixtral) with norm_topk_prob, as they are without
(--moe-router-pre-softmax), and Qwen2-MoE adds a gated shared expert (--moe-shared-expert-intermediate-size,
--moe-shared-expert-gate); Llama 3.1's RoPE scaling (rope_type
"llama3") is --use-rope-scaling. DeepSeek-V3 is multi-latent attention with YaRN (rope_type "yarn"), dense first
layers and sigmoid-routed experts with an expert bias and a shared expert; its latent norms take rms_norm_eps
(Megatron's choice), where transformers fixes 1e-6 (DeepSeek-V3's rms_norm_eps; Moonlight's 1e-5 moves the
logits by about 1e-6 of their scale). Qwen3-Next interleaves Gated DeltaNet layers (layer_types) with Qwen3
attention gated per head (--attention-output-gate) and partly rotated (--rotary-percent), its norms zero-centred
(--apply-layernorm-1p), and Qwen2-MoE's experts. Variants our model cannot reproduce exactly (other RoPE
scalings, attention or MLP biases in Llama, sliding windows outside gpt-oss, GPT-2's per-layer attention scaling) are
refused with one line rather than converted into a different network.
"""

from __future__ import annotations

import json

import torch

from megatron_lite.config.layer_pattern import layer_list_expression, linear_attention_pattern, moe_layer_pattern
from megatron_lite.config.sections import ModelConfig
from megatron_lite.files import is_a
from megatron_lite.hf.config_bounds import check_bounds
from megatron_lite.hf.gpt_oss import gpt_oss_config, gpt_oss_refusal, gpt_oss_values
from megatron_lite.hf.llama_config import (
    LLAMA3_ROPE_FLAGS,
    ConversionError,
    llama_config,
    llama_values,
    refuse,
    required,
    yarn_values,
)
from megatron_lite.model.attention.yarn import YarnScaling, yarn_mscale

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3",
                         "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss")
QWEN3_5 = ("qwen3_5_text", "qwen3_5_moe_text")  # Qwen3-Next's network, the linear projections stored apart
# Vision-language wrappers whose language model converts (as the text family; the vision tower does not)
LANGUAGE_MODELS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def language_model_config(hf: dict) -> dict:
    """The config.json of the language model: a vision-language wrapper's `text_config` as its text family's (the
    wrapper's tie_word_embeddings where it gives one); any other config.json as it is."""
    text_family = LANGUAGE_MODELS.get(hf.get("model_type"))
    if text_family is None:
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ConversionError(f"config.json of model_type {hf['model_type']} has no 'text_config' object")
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return {**text, "model_type": text_family, "tie_word_embeddings": tied}


def family_of_hf(hf: dict) -> str:
    """The family of a config.json (its model_type), or a ConversionError listing those supported."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(f"unsupported model_type {model_type!r} in config.json; supported: "
                              f"{', '.join((*SUPPORTED_MODEL_TYPES, *LANGUAGE_MODELS))}")
    return model_type


def _qwen_values(hf: dict) -> dict:
    """Qwen2 (a bias on q, k and v) and Qwen3 (RMSNorms on each query and key head): Llamas otherwise."""
    refuse(bool(hf.get("use_sliding_window")), f"sliding-window attention ({hf.get('sliding_window')})")
    if hf["model_type"] == "qwen2":
        return {**llama_values(hf), "add_qkv_bias": True}
    return {**llama_values(hf), "qk_layernorm": True}


def _mixtral_values(hf: dict) -> dict:
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


def _qwen_moe_values(hf: dict) -> dict:
    """Qwen3-MoE (Qwen3 attention) and Qwen2-MoE (Qwen2 attention and a gated shared expert), with experts in
    every layer."""
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


_GPT2_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}  # -> openai_gelu


def _gpt2_values(hf: dict) -> dict:
    activation = hf.get("activation_function", "gelu_new")
    refuse(activation not in _GPT2_ACTIVATIONS, f"activation_function {activation!r}")
    refuse(bool(hf.get("scale_attn_by_inverse_layer_idx")), "scale_attn_by_inverse_layer_idx")
    refuse(not hf.get("scale_attn_weights", True), "scale_attn_weights=false")
    refuse(bool(hf.get("add_cross_attention")), "cross-attention")
    hidden, positions = required(hf, "n_embd"), required(hf, "n_positions")
    return {"normalization": "LayerNorm", "swiglu": False, "position_embedding_type": "learned_absolute",
            "openai_gelu": _GPT2_ACTIVATIONS[activation], "disable_bias_linear": False,
            "num_layers": required(hf, "n_layer"), "hidden_size": hidden,
            "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
            "num_attention_heads": required(hf, "n_head"), "seq_length": positions,
            "max_position_embeddings": positions,
            "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)), "vocab_size": required(hf, "vocab_size"),
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
            "init_method_std": float(hf.get("initializer_range", 0.02)),
            "hidden_dropout": float(hf.get("resid_pdrop", 0.1)), "attention_dropout": float(hf.get("attn_pdrop", 0.1))}


_DEEPSEEK_INTEGER_KEYS = ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                          "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                          "num_nextn_predict_layers")
_DEEPSEEK_NUMBER_KEYS = ("routed_scaling_factor", "mscale", "mscale_all_dim", "attention_factor", "beta_fast",
                         "beta_slow", "factor")


def _deepseek_v3_values(hf: dict) -> dict:
    """DeepSeek-V3: multi-latent attention with its latent norms (--qk-layernorm), first_k_dense_replace dense
    layers (--moe-layer-freq), sigmoid routing renormalized over the top k with an expert bias, group-limited,
    scaled by routed_scaling_factor, n_shared_experts shared experts as one shared MLP, and
    num_nextn_predict_layers multi-token prediction modules."""
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


# Gated DeltaNet's shapes: the same keys in config.json as the flags
_LINEAR_ATTENTION_KEYS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                          "linear_num_key_heads", "linear_num_value_heads")


def _qwen3_next_layers(hf: dict) -> tuple[list[bool], list[bool]]:
    """(linear attention, MoE) of each layer of a Qwen3-Next: `layer_types` (else every full_attention_interval-th
    layer softmax attention), and experts where num_experts > 0, outside mlp_only_layers, every
    decoder_sparse_step-th layer (transformers' rules)."""
    layers = required(hf, "num_hidden_layers")
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["linear_attention" if (i + 1) % interval else "full_attention"
                                      for i in range(layers)]
    refuse(len(types) != layers or not set(types) <= {"linear_attention", "full_attention"},
            f"layer_types {types!r}")
    dense, step, experts = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1), hf.get("num_experts")
    moe = [bool(experts) and i not in dense and (i + 1) % step == 0 for i in range(layers)]
    return [kind == "linear_attention" for kind in types], moe


def _qwen3_next_values(hf: dict) -> dict:
    """Qwen3-Next: Gated DeltaNet layers (--experimental-attention-variant) between softmax-attention layers with
    Qwen3's per-head norms, an output gate and partial RoPE; zero-centred norms (--apply-layernorm-1p); experts
    routed by a softmax, renormalized over the top k with norm_topk_prob, with a gated shared expert. Qwen3.5's
    text models: the same, dense (qwen3_5_text) or with experts in every layer, always renormalized
    (qwen3_5_moe_text, which has no dense MLP size)."""
    if hf["model_type"] == "qwen3_5_moe_text":
        hf = {**hf, "intermediate_size": hf.get("intermediate_size") or required(hf, "moe_intermediate_size"),
              "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1}
    elif hf["model_type"] == "qwen3_5_text":
        hf = {**hf, "num_experts": None}
    linear, moe = _qwen3_next_layers(hf)
    parameters = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    values = {**llama_values(hf), "qk_layernorm": True, "attention_output_gate": True, "apply_layernorm_1p": True,
              "rotary_percent": float(parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
              "experimental_attention_variant": "gated_delta_net",
              "linear_attention_freq": layer_list_expression(linear),
              **{key: required(hf, key) for key in _LINEAR_ATTENTION_KEYS}}
    if any(moe):
        values.update(num_experts=required(hf, "num_experts"), moe_router_topk=required(hf, "num_experts_per_tok"),
                      moe_ffn_hidden_size=required(hf, "moe_intermediate_size"),
                      moe_layer_freq=layer_list_expression(moe),
                      moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
                      moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)),
                      moe_shared_expert_intermediate_size=required(hf, "shared_expert_intermediate_size"),
                      moe_shared_expert_gate=True)
    return values


_FROM_HF = {"llama": llama_values, "qwen2": _qwen_values, "qwen3": _qwen_values, "gpt2": _gpt2_values,
            "mixtral": _mixtral_values, "qwen3_moe": _qwen_moe_values, "qwen2_moe": _qwen_moe_values,
            "deepseek_v3": _deepseek_v3_values, "qwen3_next": _qwen3_next_values, "qwen3_5_text": _qwen3_next_values,
            "qwen3_5_moe_text": _qwen3_next_values, "gpt_oss": gpt_oss_values}


# The types of the config.json keys read above (null stands for a missing key), checked before any is used.
_INTEGER_KEYS = (*_DEEPSEEK_INTEGER_KEYS, "hidden_size", "num_attention_heads", "num_hidden_layers",
                 "intermediate_size", "head_dim",
                 "num_key_value_heads", "max_position_embeddings", "vocab_size", "num_local_experts", "num_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "decoder_sparse_step", "sliding_window", "n_embd", "n_positions", "n_layer", "n_head", "n_inner",
                 "full_attention_interval", *_LINEAR_ATTENTION_KEYS)
_NUMBER_KEYS = ("rms_norm_eps", "rope_theta", "initializer_range", "attention_dropout", "router_aux_loss_coef",
                "layer_norm_epsilon", "resid_pdrop", "attn_pdrop", "partial_rotary_factor", *LLAMA3_ROPE_FLAGS,
                *_DEEPSEEK_NUMBER_KEYS, "swiglu_alpha", "swiglu_limit")
_OBJECT_KEYS = ("rope_parameters", "rope_scaling")


def _check_types(hf: dict) -> None:
    """A ConversionError naming the first key of config.json (or of its RoPE parameters) of the wrong type, or out
    of its range (config_bounds.py)."""
    records = [("config.json", hf)] + [(f"config.json's {key}", hf[key]) for key in _OBJECT_KEYS
                                       if isinstance(hf.get(key), dict)]
    for where, record in records:
        for keys, kind, name in ((_INTEGER_KEYS, int, "an integer"), (_NUMBER_KEYS, float, "a number"),
                                 (_OBJECT_KEYS, dict, "an object")):
            for key in keys:
                value = record.get(key)
                if value is not None and not is_a(value, kind):
                    raise ConversionError(f"{where}: '{key}' is {json.dumps(value)[:40]}, expected {name}")
    check_bounds(hf, records)


def model_values_from_hf(hf: dict) -> dict:
    """config.json -> values of pretrain_gpt.py's model flags (ModelConfig field names)."""
    family = family_of_hf(hf)
    _check_types(hf)
    return _FROM_HF[family](hf)


# ---------------------------------------------------------------------------------------------------------
# megatron_lite -> config.json


def family_of_model(m: ModelConfig, base_model_type: str | None = None) -> str:
    """Which Hugging Face family has exactly this network, or a ConversionError saying why none does.
    `base_model_type`: the family a converted checkpoint came from, kept where it has this network (a Qwen3.5
    exports as Qwen3.5, not as the Qwen3-Next it equals)."""
    if m.experimental_attention_variant is not None:
        refusal = _qwen3_next_refusal(m)
        if refusal is None:
            all_moe = bool(m.num_experts) and all(moe_layer_pattern(m)) and not m.moe_router_pre_softmax
            if (base_model_type == "qwen3_5_text" and not m.num_experts
                    or base_model_type == "qwen3_5_moe_text" and all_moe):
                return base_model_type
            return "qwen3_next"
        raise ConversionError(f"no Hugging Face model type has this network: qwen3_next (the one with Gated DeltaNet "
                              f"layers) needs {refusal}")
    if _gpt_oss_options(m) or m.position_embedding_type == "yarn":
        refusal = gpt_oss_refusal(m)
        if refusal is None:
            return "gpt_oss"
        raise ConversionError(f"no Hugging Face model type has this network: gpt_oss (the one with "
                              f"{', '.join(_gpt_oss_options(m)) or 'YaRN'}) needs {refusal}")
    plain_norms_and_attention = not (m.apply_layernorm_1p or m.attention_output_gate or m.rotary_percent != 1
                                     or _gpt_oss_options(m))
    llama_like = (m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope"
                  and m.disable_bias_linear and plain_norms_and_attention)
    gpt2_like = (m.normalization == "LayerNorm" and not m.swiglu and m.position_embedding_type == "learned_absolute"
                 and not m.disable_bias_linear and m.num_query_groups == m.num_attention_heads
                 and plain_norms_and_attention)
    plain_attention = not m.qk_layernorm and not m.add_qkv_bias and not m.use_rope_scaling
    dense_llama = llama_like and not m.num_experts and not m.multi_latent_attention
    moe_llama = (m.num_experts and llama_like and all(moe_layer_pattern(m)) and not m.multi_latent_attention
                 and m.moe_router_score_function == "softmax"
                 and not m.moe_router_enable_expert_bias and m.moe_router_num_groups is None
                 and m.moe_router_topk_scaling_factor is None and not m.use_rope_scaling)
    shared = m.moe_shared_expert_intermediate_size
    if moe_llama and not shared and not m.moe_router_pre_softmax and plain_attention \
            and m.kv_channels in (None, m.hidden_size // m.num_attention_heads):
        return "mixtral"
    if moe_llama and not shared and m.qk_layernorm and not m.add_qkv_bias:
        return "qwen3_moe"
    if moe_llama and shared and m.moe_shared_expert_gate and not m.qk_layernorm:
        return "qwen2_moe"
    if dense_llama and m.add_qkv_bias and not m.qk_layernorm:
        return "qwen2"
    if dense_llama and m.qk_layernorm and not m.add_qkv_bias:
        return "qwen3"
    if dense_llama and not m.qk_layernorm and not m.add_qkv_bias:
        return "llama"
    if not m.num_experts and gpt2_like and plain_attention:
        return "gpt2"
    if m.multi_latent_attention:
        refusal = _deepseek_v3_refusal(m)
        if refusal is None:
            return "deepseek_v3"
        raise ConversionError(f"no Hugging Face model type has this network: deepseek_v3 (the one with multi-latent "
                              f"attention) needs {refusal}")
    raise ConversionError(
        f"no Hugging Face model type has this network (normalization={m.normalization}, swiglu={m.swiglu}, "
        f"position-embedding-type={m.position_embedding_type}, disable-bias-linear={m.disable_bias_linear}, "
        f"qk-layernorm={m.qk_layernorm}, add-qkv-bias={m.add_qkv_bias}, use-rope-scaling={m.use_rope_scaling}, "
        f"num-experts={m.num_experts}, moe-layer-freq={m.moe_layer_freq}, moe-router-pre-softmax="
        f"{m.moe_router_pre_softmax}); supported: llama (RMSNorm, SwiGLU, RoPE, no biases, optional rope scaling), "
        f"qwen2 (llama with --add-qkv-bias), qwen3 (llama with --qk-layernorm), gpt2 (LayerNorm, GELU, learned "
        f"positions, biases, no GQA), mixtral (llama with experts in every layer, softmax after top-k), qwen3_moe "
        f"(qwen3 with softmax-routed experts in every layer), qwen2_moe (qwen3_moe's routing with qwen2 attention "
        f"and a gated shared expert)")


def _qwen_config(m: ModelConfig, model_type: str, architecture: str) -> dict:
    """Qwen2 has no attention_bias key (its q, k and v always have biases); both have sliding windows, off."""
    config = llama_config(m)
    del config["mlp_bias"]
    if model_type == "qwen2":
        del config["attention_bias"]
    return {**config, "architectures": [architecture], "model_type": model_type, "use_sliding_window": False,
            "sliding_window": None}


def _mixtral_config(m: ModelConfig) -> dict:
    config = llama_config(m)
    for key in ("attention_bias", "mlp_bias", "head_dim"):  # MixtralConfig derives head_dim from the hidden size
        del config[key]
    return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": m.moe_ffn_hidden_size, "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "sliding_window": None}


def _qwen_moe_config(m: ModelConfig, model_type: str, architecture: str) -> dict:
    config = {**_qwen_config(m, "qwen2" if model_type == "qwen2_moe" else "qwen3", architecture),
              "model_type": model_type, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "moe_intermediate_size": m.moe_ffn_hidden_size, "num_experts": m.num_experts,
              "num_experts_per_tok": m.moe_router_topk, "norm_topk_prob": not m.moe_router_pre_softmax,
              "router_aux_loss_coef": m.moe_aux_loss_coeff}
    del config["sliding_window"]  # unused with use_sliding_window off; the versions' defaults differ
    if model_type == "qwen3_moe":
        return {**config, "num_local_experts": m.num_experts}  # transformers 5's name; older ones read num_experts
    return {**config, "qkv_bias": m.add_qkv_bias,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size}


def _gpt2_config(m: ModelConfig) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
            "n_inner": None if m.ffn_hidden_size == 4 * m.hidden_size else m.ffn_hidden_size,
            "n_positions": m.max_position_embeddings,
            "layer_norm_epsilon": m.norm_epsilon, "activation_function": "gelu_new" if m.openai_gelu else "gelu",
            "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "initializer_range": m.init_method_std,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}


def _deepseek_v3_refusal(m: ModelConfig) -> str | None:
    """What a multi-latent-attention model lacks to be a DeepSeek-V3, or None."""
    pattern = moe_layer_pattern(m)
    dense = pattern.index(True) if True in pattern else len(pattern)
    needs = [(m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope", "RMSNorm, SwiGLU and "
              "RoPE"), (m.qk_layernorm, "--qk-layernorm (its latent norms)"),
             (not m.apply_layernorm_1p, "norms without --apply-layernorm-1p"),
             (not _gpt_oss_options(m), f"none of {', '.join(_gpt_oss_options(m))}"),
             (bool(m.num_experts) and all(pattern[dense:]), "experts in every layer after the first dense ones"),
             (m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias, "sigmoid routing with "
              "--moe-router-enable-expert-bias"),
             (m.moe_router_group_topk is None or m.moe_router_topk == 2 * m.moe_router_group_topk,
              "--moe-router-topk twice --moe-router-group-topk (groups ranked by their top 2 scores)"),
             (bool(m.moe_shared_expert_intermediate_size) and not m.moe_shared_expert_gate
              and (m.moe_shared_expert_intermediate_size or 1) % m.moe_ffn_hidden_size == 0,
              "an ungated shared expert whose size is a multiple of --moe-ffn-hidden-size")]
    missing = [what for ok, what in needs if not ok]
    return ", ".join(missing) if missing else None


def _gpt_oss_options(m: ModelConfig) -> list[str]:
    """The gpt-oss options the model sets, which no other family converted here has."""
    options = [("--window-size", m.window_size is not None), ("--softmax-type", m.softmax_type != "vanilla"),
               ("--quick-geglu", m.quick_geglu), ("--glu-linear-offset", bool(m.glu_linear_offset)),
               ("--activation-func-clamp-value", m.activation_func_clamp_value is not None)]
    return [flag for flag, given in options if given]


def _qwen3_next_refusal(m: ModelConfig) -> str | None:
    """What a model with Gated DeltaNet layers lacks to be a Qwen3-Next, or None."""
    needs = [(not _gpt_oss_options(m), f"none of {', '.join(_gpt_oss_options(m))}"),
             (m.normalization == "RMSNorm" and m.swiglu and m.position_embedding_type == "rope"
              and m.disable_bias_linear and not m.add_qkv_bias, "RMSNorm, SwiGLU, RoPE and no biases"),
             (m.qk_layernorm and m.attention_output_gate and m.apply_layernorm_1p and not m.multi_latent_attention,
              "--qk-layernorm, --attention-output-gate and --apply-layernorm-1p"),
             (not m.use_rope_scaling, "plain RoPE (no --use-rope-scaling)")]
    if m.num_experts:
        needs += [(m.moe_router_score_function == "softmax" and not m.moe_router_enable_expert_bias
                   and m.moe_router_num_groups is None and m.moe_router_topk_scaling_factor is None,
                   "softmax routing without expert bias, groups or scaling"),
                  (bool(m.moe_shared_expert_intermediate_size) and m.moe_shared_expert_gate,
                   "a gated shared expert (--moe-shared-expert-intermediate-size, --moe-shared-expert-gate)")]
    missing = [what for ok, what in needs if not ok]
    return ", ".join(missing) if missing else None


def _hybrid_config(m: ModelConfig, model_type: str, architecture: str) -> dict:
    """What Qwen3-Next's and Qwen3.5's config.json share: a Llama's keys, partial RoPE, each layer's kind and the
    Gated DeltaNet shapes."""
    config = llama_config(m)
    del config["mlp_bias"]
    return {**config, "architectures": [architecture], "model_type": model_type,
            "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": m.rotary_percent},
            "layer_types": ["linear_attention" if linear else "full_attention"
                            for linear in linear_attention_pattern(m)],
            **{key: getattr(m, key) for key in _LINEAR_ATTENTION_KEYS}}


def _qwen3_next_config(m: ModelConfig) -> dict:
    moe = moe_layer_pattern(m)
    return {**_hybrid_config(m, "qwen3_next", "Qwen3NextForCausalLM"), "partial_rotary_factor": m.rotary_percent,
            "num_experts": m.num_experts or 0, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size or 0,
            "norm_topk_prob": not m.moe_router_pre_softmax, "router_aux_loss_coef": m.moe_aux_loss_coeff,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i, is_moe in enumerate(moe) if not is_moe]}


def _qwen3_5_config(m: ModelConfig, model_type: str) -> dict:
    if model_type == "qwen3_5_text":
        return _hybrid_config(m, model_type, "Qwen3_5ForCausalLM")
    config = _hybrid_config(m, model_type, "Qwen3_5MoeForCausalLM")
    del config["intermediate_size"]
    return {**config, "num_experts": m.num_experts, "num_experts_per_tok": m.moe_router_topk,
            "moe_intermediate_size": m.moe_ffn_hidden_size,
            "shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
            "router_aux_loss_coef": m.moe_aux_loss_coeff}


def _deepseek_v3_config(m: ModelConfig) -> dict:
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


_TO_HF = {"llama": llama_config, "qwen2": lambda m: _qwen_config(m, "qwen2", "Qwen2ForCausalLM"),
          "qwen3": lambda m: _qwen_config(m, "qwen3", "Qwen3ForCausalLM"), "gpt2": _gpt2_config,
          "mixtral": _mixtral_config,
          "qwen3_moe": lambda m: _qwen_moe_config(m, "qwen3_moe", "Qwen3MoeForCausalLM"),
          "qwen2_moe": lambda m: _qwen_moe_config(m, "qwen2_moe", "Qwen2MoeForCausalLM"),
          "deepseek_v3": _deepseek_v3_config, "qwen3_next": _qwen3_next_config,
          **{model_type: lambda m, t=model_type: _qwen3_5_config(m, t) for model_type in QWEN3_5},
          "gpt_oss": gpt_oss_config}


def hf_config_from_model(m: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """config.json for model `m` whose weights are stored in `dtype`. `base` (the config.json a converted
    checkpoint came from) keeps what the network does not decide, such as bos/eos token ids."""
    family = family_of_model(m, (base or {}).get("model_type"))
    config = dict(base) if base and base.get("model_type") == family else {}
    config.update(_TO_HF[family](m))
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name  # transformers 5; older versions read torch_dtype
    config["torch_dtype"] = dtype_name
    return config
