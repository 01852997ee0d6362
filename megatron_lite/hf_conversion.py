"""Hugging Face <-> megatron_lite weight mapping for the llama and gpt2 families.

Both directions work on global tensors keyed by megatron_lite's global parameter names, so a converted
state can be loaded into any parallel layout (each rank cuts its shards with `sharding.shard`).
The one non-trivial step is the fused QKV weight, laid out per query group: [q heads of group 0, k_0,
v_0, q heads of group 1, k_1, v_1, ...], and SwiGLU's fc1, which stacks [gate; up].
"""

from __future__ import annotations

import torch

from megatron_lite.config import ModelConfig


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


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if weight.shape[0] == rows:
        return weight
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], *weight.shape[1:])])


def llama_from_hf(hf: dict[str, torch.Tensor], config: ModelConfig, padded_vocab: int) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state dict -> global megatron_lite tensors."""
    out = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], padded_vocab),
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = _pad_rows(hf.get("lm_head.weight", hf["model.embed_tokens.weight"]),
                                               padded_vocab)
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], config)
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]])
        out[dst + "mlp.linear_fc2.weight"] = hf[src + "mlp.down_proj.weight"]
    return out


def gpt2_from_hf(hf: dict[str, torch.Tensor], config: ModelConfig, padded_vocab: int) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel state dict -> global megatron_lite tensors (HF's Conv1D weights are transposed)."""
    hf = {k.removeprefix("transformer."): v for k, v in hf.items()}
    out = {"embedding.word_embeddings.weight": _pad_rows(hf["wte.weight"], padded_vocab),
           "embedding.position_embeddings": hf["wpe.weight"][:config.max_position_embeddings],
           "decoder.final_layernorm.weight": hf["ln_f.weight"],
           "decoder.final_layernorm.bias": hf["ln_f.bias"]}
    for i in range(config.num_layers):
        src, dst = f"h.{i}.", f"decoder.layers.{i}."
        for ours, theirs in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            out[f"{dst}{ours}.weight"] = hf[f"{src}{theirs}.weight"]
            out[f"{dst}{ours}.bias"] = hf[f"{src}{theirs}.bias"]
        q, k, v = hf[src + "attn.c_attn.weight"].t().chunk(3)
        qb, kb, vb = hf[src + "attn.c_attn.bias"].chunk(3)
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, config)
        out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(qb, kb, vb, config)
        for ours, theirs in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                             ("mlp.linear_fc2", "mlp.c_proj")):
            out[f"{dst}{ours}.weight"] = hf[f"{src}{theirs}.weight"].t()
            out[f"{dst}{ours}.bias"] = hf[f"{src}{theirs}.bias"]
    return out
