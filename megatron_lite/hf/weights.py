"""Hugging Face tensors <-> global megatron_lite tensors, for the llama, qwen2, qwen3, gpt2 and mixtral families.

Both directions work on whole (global) tensors keyed by megatron_lite's global parameter names with the
unpadded vocabulary, which is what a checkpoint stores, so the result loads into any parallel layout.
The non-trivial steps:
  fused QKV    laid out per query group, [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...],
               so tensor parallelism can split whole groups (model/attention.py)
  SwiGLU fc1   [gate; up] stacked, for the dense MLP and for every expert
  qwen2, qwen3 Llama's names, plus the q/k/v biases (fused like the weights) or the q/k head norms
  GPT-2        HF's Conv1D stores weights as [in, out]: transposed here; its c_attn is [q; k; v]
  RoPE         ours is HF's "rotate half" layout (model/attention.py), so q and k need no permutation
The expected HF shapes (`hf_shapes`) come from the config, so a file that does not match it is reported
before anything is converted.
"""

from __future__ import annotations

import torch

from megatron_lite.config import ModelConfig

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
# Buffers some HF checkpoints carry that are not weights.
_NOT_WEIGHTS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
# GPT-2 per-layer names (ours, HF's) shared by both directions; HF's Conv1D linears are stored transposed.
_GPT2_NORMS = (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2"))
_GPT2_TRANSPOSED_LINEARS = (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                            ("mlp.linear_fc2", "mlp.c_proj"))
# Qwen3's per-head norms (--qk-layernorm), ours under self_attention., HF's under self_attn.
_QK_NORMS = (("q_layernorm.weight", "q_norm.weight"), ("k_layernorm.weight", "k_norm.weight"))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Separate q [nh*d, ..], k, v [ng*d, ..] -> fused per-query-group [(nh + 2ng)*d, ..]."""
    ng, d = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // ng
    rest = q.shape[1:]
    q = q.reshape(ng, per_group * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`."""
    ng, d = config.num_query_groups, config.head_dim
    per_group = config.num_attention_heads // ng
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, (per_group + 2) * d, *rest)
    q, k, v = grouped.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def is_weight(hf_name: str) -> bool:
    return not hf_name.endswith(_NOT_WEIGHTS)


def normalize_hf_names(family: str, names) -> dict[str, str]:
    """{canonical name: name in the file}: GPT-2 files from the Hub omit save_pretrained's `transformer.`."""
    if family != "gpt2":
        return {name: name for name in names}
    return {name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}": name for name in names}


# ---------------------------------------------------------------------------------------------------------
# Expected shapes


def hf_shapes(family: str, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Hugging Face checkpoint of this configuration holds, with its shape."""
    h, v, ffn = m.hidden_size, m.vocab_size, m.ffn_hidden_size
    untied = m.untie_embeddings_and_output_weights
    if family == "gpt2":
        shapes = {"transformer.wte.weight": (v, h), "transformer.wpe.weight": (m.max_position_embeddings, h),
                  "transformer.ln_f.weight": (h,), "transformer.ln_f.bias": (h,)}
        for i in range(m.num_layers):
            p = f"transformer.h.{i}."
            shapes.update({p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
                           p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
                           p + "attn.c_attn.weight": (h, 3 * h), p + "attn.c_attn.bias": (3 * h,),
                           p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
                           p + "mlp.c_fc.weight": (h, ffn), p + "mlp.c_fc.bias": (ffn,),
                           p + "mlp.c_proj.weight": (ffn, h), p + "mlp.c_proj.bias": (h,)})
        return shapes | ({"lm_head.weight": (v, h)} if untied else {})
    q, kv = m.num_attention_heads * m.head_dim, m.num_query_groups * m.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if m.add_qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if m.qk_layernorm:
            shapes.update({f"{p}self_attn.{theirs}": (m.head_dim,) for _, theirs in _QK_NORMS})
        if family == "mixtral":
            e_ffn = m.moe_ffn_hidden_size
            shapes[p + "block_sparse_moe.gate.weight"] = (m.num_experts, h)
            for e in range(m.num_experts):
                x = f"{p}block_sparse_moe.experts.{e}."
                shapes.update({x + "w1.weight": (e_ffn, h), x + "w3.weight": (e_ffn, h), x + "w2.weight": (h, e_ffn)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                           p + "mlp.down_proj.weight": (h, ffn)})
    return shapes | ({"lm_head.weight": (v, h)} if untied else {})


def megatron_shapes(family: str, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The global tensors (unpadded vocabulary) a megatron_lite checkpoint of this configuration holds."""
    meta = {name: torch.empty(shape, device="meta") for name, shape in hf_shapes(family, m).items()}
    return {name: tuple(t.shape) for name, t in to_megatron(family, meta, m).items()}


def shape_problems(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> list[str]:
    """Missing tensors, tensors whose shape differs from the configuration's, and unexpected tensors."""
    problems = [f"{where} has no tensor '{name}'" for name in expected if name not in found]
    problems += [f"{where}: '{name}' has shape {tuple(found[name])} but the configuration implies {shape}"
                 for name, shape in expected.items() if name in found and tuple(found[name]) != shape]
    problems += [f"{where} holds '{name}', which this configuration has no place for"
                 for name in found if name not in expected]
    return problems


# ---------------------------------------------------------------------------------------------------------
# HF -> megatron_lite


def _llama_attention_to_megatron(hf, src: str, dst: str, m: ModelConfig, out: dict) -> None:
    out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
    out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
    attn = src + "self_attn."
    out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
        hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], m)
    out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
    if m.add_qkv_bias:
        out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
            hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], m)
    if m.qk_layernorm:
        for ours, theirs in _QK_NORMS:
            out[f"{dst}self_attention.{ours}"] = hf[attn + theirs]


def _llama_to_megatron(hf, m: ModelConfig, layers, moe: bool) -> dict[str, torch.Tensor]:
    out = {WORD_EMBEDDINGS: hf["model.embed_tokens.weight"]}
    for i in layers(range(m.num_layers)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        _llama_attention_to_megatron(hf, src, dst, m, out)
        if moe:
            out[dst + "mlp.router.weight"] = hf[src + "block_sparse_moe.gate.weight"]
            for e in range(m.num_experts):
                x = f"{src}block_sparse_moe.experts.{e}."
                out[f"{dst}mlp.experts.{e}.linear_fc1.weight"] = torch.cat([hf[x + "w1.weight"], hf[x + "w3.weight"]])
                out[f"{dst}mlp.experts.{e}.linear_fc2.weight"] = hf[x + "w2.weight"]
        else:
            out[dst + "mlp.linear_fc1.weight"] = torch.cat([hf[src + "mlp.gate_proj.weight"],
                                                           hf[src + "mlp.up_proj.weight"]])
            out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def _gpt2_to_megatron(hf, m: ModelConfig, layers) -> dict[str, torch.Tensor]:
    out = {WORD_EMBEDDINGS: hf["transformer.wte.weight"], "embedding.position_embeddings": hf["transformer.wpe.weight"]}
    for i in layers(range(m.num_layers)):
        src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for ours, theirs in _GPT2_NORMS:
            out[f"{dst}{ours}.weight"] = hf[f"{src}{theirs}.weight"]
            out[f"{dst}{ours}.bias"] = hf[f"{src}{theirs}.bias"]
        q, k, v = hf[src + "attn.c_attn.weight"].t().chunk(3)
        qb, kb, vb = hf[src + "attn.c_attn.bias"].chunk(3)
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, m)
        out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(qb, kb, vb, m)
        for ours, theirs in _GPT2_TRANSPOSED_LINEARS:
            out[f"{dst}{ours}.weight"] = hf[f"{src}{theirs}.weight"].t()
            out[f"{dst}{ours}.bias"] = hf[f"{src}{theirs}.bias"]
    out["decoder.final_layernorm.weight"] = hf["transformer.ln_f.weight"]
    out["decoder.final_layernorm.bias"] = hf["transformer.ln_f.bias"]
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def to_megatron(family: str, hf, m: ModelConfig, layers=iter) -> dict[str, torch.Tensor]:
    """HF weights (a mapping by canonical name) -> global megatron_lite tensors. `layers` wraps the loop over
    layer indices (a progress bar)."""
    if family == "gpt2":
        return _gpt2_to_megatron(hf, m, layers)
    return _llama_to_megatron(hf, m, layers, moe=family == "mixtral")


# ---------------------------------------------------------------------------------------------------------
# megatron_lite -> HF


def _llama_attention_to_hf(t: dict, src: str, dst: str, m: ModelConfig, out: dict) -> None:
    out[dst + "input_layernorm.weight"] = t[src + "input_layernorm.weight"]
    out[dst + "post_attention_layernorm.weight"] = t[src + "pre_mlp_layernorm.weight"]
    attn = dst + "self_attn."
    q, k, v = split_qkv(t[src + "self_attention.linear_qkv.weight"], m)
    out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v,
                attn + "o_proj.weight": t[src + "self_attention.linear_proj.weight"]})
    if m.add_qkv_bias:
        q, k, v = split_qkv(t[src + "self_attention.linear_qkv.bias"], m)
        out.update({attn + "q_proj.bias": q, attn + "k_proj.bias": k, attn + "v_proj.bias": v})
    if m.qk_layernorm:
        for ours, theirs in _QK_NORMS:
            out[attn + theirs] = t[f"{src}self_attention.{ours}"]


def _llama_to_hf(t: dict, m: ModelConfig, layers, moe: bool) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": t[WORD_EMBEDDINGS][:m.vocab_size]}
    for i in layers(range(m.num_layers)):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        _llama_attention_to_hf(t, src, dst, m, out)
        if moe:
            out[dst + "block_sparse_moe.gate.weight"] = t[src + "mlp.router.weight"]
            for e in range(m.num_experts):
                x = f"{dst}block_sparse_moe.experts.{e}."
                gate, up = t[f"{src}mlp.experts.{e}.linear_fc1.weight"].chunk(2)
                out.update({x + "w1.weight": gate, x + "w2.weight": t[f"{src}mlp.experts.{e}.linear_fc2.weight"],
                            x + "w3.weight": up})
        else:
            gate, up = t[src + "mlp.linear_fc1.weight"].chunk(2)
            out.update({dst + "mlp.gate_proj.weight": gate, dst + "mlp.up_proj.weight": up,
                        dst + "mlp.down_proj.weight": t[src + "mlp.linear_fc2.weight"]})
    out["model.norm.weight"] = t["decoder.final_layernorm.weight"]
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = t["output_layer.weight"][:m.vocab_size]
    return out


def _gpt2_to_hf(t: dict, m: ModelConfig, layers) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": t[WORD_EMBEDDINGS][:m.vocab_size],
           "transformer.wpe.weight": t["embedding.position_embeddings"]}
    for i in layers(range(m.num_layers)):
        src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
        for ours, theirs in _GPT2_NORMS:
            out[f"{dst}{theirs}.weight"] = t[f"{src}{ours}.weight"]
            out[f"{dst}{theirs}.bias"] = t[f"{src}{ours}.bias"]
        q, k, v = split_qkv(t[src + "self_attention.linear_qkv.weight"], m)
        out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
        out[dst + "attn.c_attn.bias"] = torch.cat(split_qkv(t[src + "self_attention.linear_qkv.bias"], m))
        for ours, theirs in _GPT2_TRANSPOSED_LINEARS:
            out[f"{dst}{theirs}.weight"] = t[f"{src}{ours}.weight"].t()
            out[f"{dst}{theirs}.bias"] = t[f"{src}{ours}.bias"]
    out["transformer.ln_f.weight"] = t["decoder.final_layernorm.weight"]
    out["transformer.ln_f.bias"] = t["decoder.final_layernorm.bias"]
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = t["output_layer.weight"][:m.vocab_size]
    return out


def to_hf(family: str, tensors: dict, m: ModelConfig, layers=iter) -> dict[str, torch.Tensor]:
    """Global megatron_lite tensors -> HF weights under save_pretrained's names (any vocabulary padding dropped)."""
    if family == "gpt2":
        return _gpt2_to_hf(tensors, m, layers)
    return _llama_to_hf(tensors, m, layers, moe=family == "mixtral")
