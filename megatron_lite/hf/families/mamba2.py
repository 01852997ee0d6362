"""Mamba-2 (transformers' mamba2): its config.json <-> megatron_lite model flags, the network it recognises and its
name table.

A stack of Mamba-2 blocks alone, each an RMSNorm and a mixer with its residual: --hybrid-layer-pattern of as many
M, a Mamba-2 mixer with no MLP after it being a layer of its own. The mixers' tensors are Nemotron-H's, under the
same names (families/nemotron_h.py). transformers keeps the residual stream in fp32 where residual_in_fp32 is set,
as it is by default: the same network, whose sums ours rounds to the model's dtype (in fp32 the two agree to
float rounding). Biases, time-step limits and other activations or kernel sizes are refused with one line.
"""

from __future__ import annotations

from megatron_lite.config.sections import ModelConfig
from megatron_lite.hf.configs import refuse, required
from megatron_lite.hf.families.family import Family, refuse_network
from megatron_lite.hf.families.nemotron_h import mamba_rules, refuse_other_mixers, stored_blocks
from megatron_lite.hf.name_tables import VOCAB_ROWS, NameTable, Rule, output_layer


def _values(hf: dict) -> dict:
    refuse(bool(hf.get("use_bias")), "a mamba2 with biases")
    refuse_other_mixers(hf, "hidden_act")
    hidden, heads, head_dim = required(hf, "hidden_size"), required(hf, "num_heads"), required(hf, "head_dim")
    refuse(int(hf.get("expand", 2) * hidden) != heads * head_dim,
           f"expand x hidden_size ({hf.get('expand', 2)} x {hidden}) other than num_heads x head_dim")
    return {"hybrid_layer_pattern": "M" * required(hf, "num_hidden_layers"), "hidden_size": hidden,
            "vocab_size": required(hf, "vocab_size"), "normalization": "RMSNorm",
            "norm_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)), "position_embedding_type": "none",
            "disable_bias_linear": True, "untie_embeddings_and_output_weights": not hf.get("tie_word_embeddings", True),
            "mamba_num_heads": heads, "mamba_head_dim": head_dim, "mamba_state_dim": required(hf, "state_size"),
            "mamba_num_groups": hf.get("n_groups", 1), "hidden_dropout": 0.0}


def _recognises(m: ModelConfig) -> bool:
    """A stack of Mamba-2 layers alone is Mamba-2's, or no family's."""
    if set((m.hybrid_layer_pattern or "").replace("|", "")) != {"M"}:
        return False
    refuse_network("mamba2", "Mamba-2 layers alone", [
        (m.normalization == "RMSNorm" and m.disable_bias_linear and m.position_embedding_type == "none",
         "RMSNorm, no biases and --position-embedding-type none"),
        (not m.mtp_num_layers, "no multi-token prediction")])
    return True


def _config(m: ModelConfig) -> dict:
    """The network's keys; chunk_size and residual_in_fp32 are left to the checkpoint's own config.json, or to
    transformers' defaults (which keep the residual stream in fp32)."""
    heads = m.mamba_num_heads or 2 * m.hidden_size // m.mamba_head_dim
    return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers, "vocab_size": m.vocab_size, "layer_norm_epsilon": m.norm_epsilon,
            "num_heads": heads, "head_dim": m.mamba_head_dim, "expand": heads * m.mamba_head_dim / m.hidden_size,
            "state_size": m.mamba_state_dim, "n_groups": m.mamba_num_groups, "conv_kernel": 4, "use_bias": False,
            "use_conv_bias": True, "hidden_act": "silu",
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights}


def _name_table(m: ModelConfig) -> NameTable:
    h = m.hidden_size
    norm = Rule("decoder.layers.{layer}.input_layernorm.weight", ("backbone.layers.{mixer}.norm.weight",),
                lambda m: ((h,),))
    mixer = mamba_rules(m)
    return NameTable(
        head=[Rule("embedding.word_embeddings.weight", ("backbone.embeddings.weight",), lambda m: ((m.vocab_size, h),),
                   VOCAB_ROWS)],
        layer=lambda spec: [norm, *mixer],
        tail=[Rule("decoder.final_layernorm.weight", ("backbone.norm_f.weight",), lambda m: ((h,),)),
              *output_layer(m, "lm_head.weight")],
        blocks=stored_blocks(m))


MAMBA2 = Family("mamba2", _values, _config, _recognises, _name_table)
