"""The Hugging Face families, one module each (a `Family`: its config.json both ways, the network it recognises and
its name table), and what the rest of the package asks of them: which family a config.json or a megatron_lite model
is, and config.json -> model flags and back.

`FAMILIES` lists them in the order `family_of_model` asks whether a network is theirs. A family whose feature no
other has (Mamba-2 layers, Gated DeltaNet layers, gpt-oss's options, multi-latent attention) refuses with one line a
network that has the feature but not the rest of its network, rather than let it be converted into a different one.
"""

from __future__ import annotations

import torch

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.config_bounds import check_config_json
from megatron_lite.hf.configs import ConversionError
from megatron_lite.hf.families.deepseek_v3 import DEEPSEEK_V3
from megatron_lite.hf.families.family import Family
from megatron_lite.hf.families.gpt2 import GPT2
from megatron_lite.hf.families.gpt_oss import GPT_OSS
from megatron_lite.hf.families.llama import LLAMA
from megatron_lite.hf.families.mamba2 import MAMBA2
from megatron_lite.hf.families.mixtral import MIXTRAL
from megatron_lite.hf.families.nemotron_h import NEMOTRON_H
from megatron_lite.hf.families.qwen import QWEN2, QWEN3
from megatron_lite.hf.families.qwen3_next import QWEN3_5_MOE_TEXT, QWEN3_5_TEXT, QWEN3_NEXT
from megatron_lite.hf.families.qwen_moe import QWEN2_MOE, QWEN3_MOE

FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    MAMBA2, NEMOTRON_H, QWEN3_5_TEXT, QWEN3_5_MOE_TEXT, QWEN3_NEXT, GPT_OSS, MIXTRAL, QWEN3_MOE, QWEN2_MOE, QWEN2,
    QWEN3, LLAMA, GPT2, DEEPSEEK_V3)}
# In the order an unsupported model_type's message lists them
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gpt2", "mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3",
                         "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gpt_oss", "nemotron_h", "mamba2")
# Vision-language wrappers whose language model converts (as the text family; the vision tower does not)
LANGUAGE_MODELS = {family.language_model_of: family.model_type for family in FAMILIES.values()
                   if family.language_model_of}


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
    if model_type not in FAMILIES:
        raise ConversionError(f"unsupported model_type {model_type!r} in config.json; supported: "
                              f"{', '.join((*SUPPORTED_MODEL_TYPES, *LANGUAGE_MODELS))}")
    return model_type


def model_values_from_hf(hf: dict) -> dict:
    """config.json -> values of pretrain_gpt.py's model flags (ModelConfig field names)."""
    family = family_of_hf(hf)
    check_config_json(hf)
    return FAMILIES[family].values(hf)


def family_of_model(m: ModelConfig, base_model_type: str | None = None) -> str:
    """Which Hugging Face family has exactly this network, or a ConversionError saying why none does.
    `base_model_type`: the family a converted checkpoint came from, kept where it has this network (a Qwen3.5
    exports as Qwen3.5, not as the Qwen3-Next it equals)."""
    for family in FAMILIES.values():
        if (family.detected or family.model_type == base_model_type) and family.recognises(m):
            return family.model_type
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


def hf_config_from_model(m: ModelConfig, dtype: torch.dtype, base: dict | None = None) -> dict:
    """config.json for model `m` whose weights are stored in `dtype`. `base` (the config.json a converted
    checkpoint came from) keeps what the network does not decide, such as bos/eos token ids."""
    family = family_of_model(m, (base or {}).get("model_type"))
    config = dict(base) if base and base.get("model_type") == family else {}
    config.update(FAMILIES[family].config(m))
    dtype_name = str(dtype).removeprefix("torch.")
    config["dtype"] = dtype_name  # transformers 5; older versions read torch_dtype
    config["torch_dtype"] = dtype_name
    return config
