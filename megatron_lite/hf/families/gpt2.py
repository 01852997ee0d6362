"""GPT-2 (transformers' gpt2): LayerNorms, GELU (gelu_new is --openai-gelu), learned positions, biases in every
linear, no grouped-query attention; its Conv1D weights stored as [in, out] and q, k, v packed in one c_attn.
GPT-2's per-layer attention scaling and cross-attention are refused."""

from __future__ import annotations

import torch

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse, required
from megatron_lite.hf.families.family import Family
from megatron_lite.hf.families.llama import plain_attention, plain_norms_and_attention
from megatron_lite.hf.name_tables import (
    SAME,
    VOCAB_ROWS,
    NameTable,
    Rule,
    Transform,
    fuse_qkv,
    output_layer,
    split_qkv,
    transposed,
)

_ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu": False}  # -> openai_gelu


def _values(hf: dict) -> dict:
    activation = hf.get("activation_function", "gelu_new")
    refuse(activation not in _ACTIVATIONS, f"activation_function {activation!r}")
    refuse(bool(hf.get("scale_attn_by_inverse_layer_idx")), "scale_attn_by_inverse_layer_idx")
    refuse(not hf.get("scale_attn_weights", True), "scale_attn_weights=false")
    refuse(bool(hf.get("add_cross_attention")), "cross-attention")
    hidden, positions = required(hf, "n_embd"), required(hf, "n_positions")
    return {"normalization": "LayerNorm", "swiglu": False, "position_embedding_type": "learned_absolute",
            "openai_gelu": _ACTIVATIONS[activation], "disable_bias_linear": False,
            "num_layers": required(hf, "n_layer"), "hidden_size": hidden,
            "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
            "num_attention_heads": required(hf, "n_head"), "seq_length": positions,
            "max_position_embeddings": positions,
            "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)), "vocab_size": required(hf, "vocab_size"),
            "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
            "init_method_std": float(hf.get("initializer_range", 0.02)),
            "hidden_dropout": float(hf.get("resid_pdrop", 0.1)), "attention_dropout": float(hf.get("attn_pdrop", 0.1))}


def _config(m: ModelConfig) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
            "n_embd": m.hidden_size, "n_layer": m.num_layers, "n_head": m.num_attention_heads,
            "n_inner": None if m.ffn_hidden_size == 4 * m.hidden_size else m.ffn_hidden_size,
            "n_positions": m.max_position_embeddings,
            "layer_norm_epsilon": m.norm_epsilon, "activation_function": "gelu_new" if m.openai_gelu else "gelu",
            "resid_pdrop": m.hidden_dropout, "embd_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "initializer_range": m.init_method_std,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False}


def _recognises(m: ModelConfig) -> bool:
    return (not m.num_experts and m.normalization == "LayerNorm" and not m.swiglu
            and m.position_embedding_type == "learned_absolute" and not m.disable_bias_linear
            and m.num_query_groups == m.num_attention_heads and plain_norms_and_attention(m) and plain_attention(m))


# GPT-2's one [q; k; v] tensor -> fused per query group
PACKED_QKV = Transform(lambda hf, m: fuse_qkv(*hf[0].chunk(3), m), lambda t, m: [torch.cat(split_qkv(t, m))])


def _h(m):
    return m.hidden_size


def _name_table(m: ModelConfig) -> NameTable:
    """LayerNorms and linears with biases, learned positions, a packed [q; k; v] c_attn."""
    ours, theirs = "decoder.layers.{layer}.", "transformer.h.{layer}."
    layer = []
    for our_norm, their_norm in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
        layer += [Rule(f"{ours}{our_norm}.{p}", (f"{theirs}{their_norm}.{p}",), lambda m: ((_h(m),),))
                  for p in ("weight", "bias")]
    layer += [Rule(ours + "self_attention.linear_qkv.weight", (theirs + "attn.c_attn.weight",),
                   lambda m: ((_h(m), 3 * _h(m)),), transposed(PACKED_QKV)),
              Rule(ours + "self_attention.linear_qkv.bias", (theirs + "attn.c_attn.bias",),
                   lambda m: ((3 * _h(m),),), PACKED_QKV)]
    for our_linear, their_linear, fan_in, fan_out in (
            ("self_attention.linear_proj", "attn.c_proj", _h, _h),
            ("mlp.linear_fc1", "mlp.c_fc", _h, lambda m: m.ffn_hidden_size),
            ("mlp.linear_fc2", "mlp.c_proj", lambda m: m.ffn_hidden_size, _h)):
        layer += [Rule(f"{ours}{our_linear}.weight", (f"{theirs}{their_linear}.weight",),
                       lambda m, i=fan_in, o=fan_out: ((i(m), o(m)),), transposed(SAME)),
                  Rule(f"{ours}{our_linear}.bias", (f"{theirs}{their_linear}.bias",),
                       lambda m, o=fan_out: ((o(m),),))]
    return NameTable(
        head=[Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",),
                   lambda m: ((m.vocab_size, _h(m)),), VOCAB_ROWS),
              Rule("embedding.position_embeddings", ("transformer.wpe.weight",),
                   lambda m: ((m.max_position_embeddings, _h(m)),))],
        layer=lambda spec: layer,
        tail=[Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",), lambda m: ((_h(m),),)),
              Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",), lambda m: ((_h(m),),)),
              *output_layer(m, "lm_head.weight")])


GPT2 = Family("gpt2", _values, _config, _recognises, _name_table)
