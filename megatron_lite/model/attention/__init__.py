"""Attention variants and what they share.

    self_attention.py   causal self-attention: grouped-query attention, rotary embeddings, swappable kernels
    mla.py              multi-latent attention (DeepSeek-V2/V3)
    yarn.py             YaRN rotary scaling
    context_parallel.py the sequence split over the cp group, and causal attention across it
"""
