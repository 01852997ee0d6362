"""Named model shapes for `--model-preset`: each fills the model flags, which explicit flags override."""

_LLAMA = {
    "normalization": "RMSNorm",
    "swiglu": True,
    "position_embedding_type": "rope",
    "untie_embeddings_and_output_weights": True,
    "disable_bias_linear": True,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "group_query_attention": True,
}

# NVIDIA's Nemotron-H and Nemotron 3 (Megatron-Bridge's and the checkpoints' config.json): Mamba-2 layers of 64-wide
# heads in 8 groups with a 128 state, attention of 32 heads of 128 without positional embeddings, squared-ReLU MLPs,
# RMSNorm, no biases, untied output layer, a 131,072-token vocabulary
_NEMOTRON = {
    **_LLAMA, "swiglu": False, "squared_relu": True, "position_embedding_type": "none", "num_attention_heads": 32,
    "kv_channels": 128, "mamba_head_dim": 64, "mamba_state_dim": 128, "mamba_num_groups": 8, "vocab_size": 131072,
    "norm_epsilon": 1e-5,
}

# DeepSeek-V3's architecture: multi-latent attention (heads of 128 + 64 query-key and 128 value dimensions) with its
# latent norms; sigmoid routing renormalized over the top k, an aux-loss-free expert bias (update rate 0.001) and
# the per-sequence balance loss of weight 0.0001, as the paper trains it
_DEEPSEEK_V3 = {
    **_LLAMA, "group_query_attention": False, "multi_latent_attention": True, "qk_layernorm": True,
    "qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 1e-3,
    "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 1e-4,
}

# Qwen3-Next and Qwen3.5: three Gated DeltaNet layers (16 query/key heads of 128, 32 value heads of 128, a
# 4-wide convolution), then one softmax-attention layer of 16 heads of 256 with an output gate, a quarter of each
# head rotated (RoPE base 1e7), q/k norms, every norm zero-centred
_QWEN3_NEXT = {
    **_LLAMA, "qk_layernorm": True, "attention_output_gate": True, "apply_layernorm_1p": True, "rotary_percent": 0.25,
    "kv_channels": 256, "num_attention_heads": 16, "rotary_base": 10000000.0, "norm_epsilon": 1e-6,
    "seq_length": 4096, "max_position_embeddings": 262144, "experimental_attention_variant": "gated_delta_net",
    "linear_attention_freq": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
}
# Their MoE layers: experts of 512, a gated shared expert of 512, a softmax renormalized over the top k
_QWEN3_NEXT_MOE = {
    "moe_ffn_hidden_size": 512, "moe_shared_expert_intermediate_size": 512, "moe_shared_expert_gate": True,
    "moe_aux_loss_coeff": 0.001,
}

# gpt-oss: 64 query heads of 64 over 8 key/value groups at hidden size 2880, biases in every linear, a learned sink
# per head, a 128-token window (127 keys before the query) on every other layer from the first, YaRN stretching a
# 4K context 32 times without rounding its band, experts of 2880 with the clamped quick-GELU unit, 4 per token
# routed by a softmax over the top 4 logits; Megatron-LM's gpt-oss recipe trains with no balancing loss
_GPT_OSS = {
    **_LLAMA, "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
    "disable_bias_linear": False, "softmax_type": "learnable", "window_size": [127, 0], "window_attn_skip_freq": 2,
    "position_embedding_type": "yarn", "rotary_base": 150000.0, "rotary_scaling_factor": 32.0,
    "yarn_original_max_position_embeddings": 4096, "yarn_correction_range_round_to_int": False,
    "hidden_size": 2880, "ffn_hidden_size": 2880, "moe_ffn_hidden_size": 2880, "num_attention_heads": 64,
    "kv_channels": 64, "num_query_groups": 8, "vocab_size": 201088, "seq_length": 4096,
    "max_position_embeddings": 131072, "norm_epsilon": 1e-5, "moe_router_topk": 4,
}

MODEL_PRESETS: dict[str, dict] = {
    "gpt2-124m": {
        "num_layers": 12, "hidden_size": 768, "ffn_hidden_size": 3072, "num_attention_heads": 12,
        "seq_length": 1024, "max_position_embeddings": 1024, "vocab_size": 50257,
        "normalization": "LayerNorm", "position_embedding_type": "learned_absolute",
        "hidden_dropout": 0.1, "attention_dropout": 0.1, "init_method_std": 0.02, "openai_gelu": True,
    },
    "llama-tiny": {
        **_LLAMA, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 384, "num_attention_heads": 4,
        "num_query_groups": 2, "seq_length": 128, "max_position_embeddings": 128, "vocab_size": 1024,
        "norm_epsilon": 1e-5, "rotary_base": 10000.0,
    },
    "llama3-8b": {
        **_LLAMA, "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 14336, "num_attention_heads": 32,
        "num_query_groups": 8, "seq_length": 8192, "max_position_embeddings": 8192, "vocab_size": 128256,
        "norm_epsilon": 1e-5, "rotary_base": 500000.0, "init_method_std": 0.02,
    },
    "llama3-70b": {
        **_LLAMA, "num_layers": 80, "hidden_size": 8192, "ffn_hidden_size": 28672, "num_attention_heads": 64,
        "num_query_groups": 8, "seq_length": 8192, "max_position_embeddings": 8192, "vocab_size": 128256,
        "norm_epsilon": 1e-5, "rotary_base": 500000.0, "init_method_std": 0.02,
    },
    "llama3.1-405b": {  # Llama 3.1's RoPE scaling (factor 8) for its 128K context
        **_LLAMA, "num_layers": 126, "hidden_size": 16384, "ffn_hidden_size": 53248, "num_attention_heads": 128,
        "num_query_groups": 8, "seq_length": 8192, "max_position_embeddings": 131072, "vocab_size": 128256,
        "norm_epsilon": 1e-5, "rotary_base": 500000.0, "init_method_std": 0.02, "use_rope_scaling": True,
        "rope_scaling_factor": 8.0, "rope_scaling_low_freq_factor": 1.0, "rope_scaling_high_freq_factor": 4.0,
        "rope_scaling_original_max_position_embeddings": 8192,
    },
    "llama3.2-1b": {  # tied embeddings and Llama 3.1's RoPE scaling (factor 32 for 3.2)
        **_LLAMA, "num_layers": 16, "hidden_size": 2048, "ffn_hidden_size": 8192, "num_attention_heads": 32,
        "num_query_groups": 8, "seq_length": 8192, "max_position_embeddings": 131072, "vocab_size": 128256,
        "norm_epsilon": 1e-5, "rotary_base": 500000.0, "untie_embeddings_and_output_weights": False,
        "use_rope_scaling": True, "rope_scaling_factor": 32.0, "rope_scaling_low_freq_factor": 1.0,
        "rope_scaling_high_freq_factor": 4.0, "rope_scaling_original_max_position_embeddings": 8192,
    },
    "qwen3-0.6b": {  # heads of 128 channels (16 x 128 > hidden 1024), q/k norms, tied embeddings
        **_LLAMA, "num_layers": 28, "hidden_size": 1024, "ffn_hidden_size": 3072, "num_attention_heads": 16,
        "num_query_groups": 8, "kv_channels": 128, "seq_length": 4096, "max_position_embeddings": 40960,
        "vocab_size": 151936, "norm_epsilon": 1e-6, "rotary_base": 1000000.0, "qk_layernorm": True,
        "untie_embeddings_and_output_weights": False,
    },
    "qwen3-30b-a3b": {  # 128 fine-grained experts, 8 per token, softmax renormalized over the 8
        **_LLAMA, "num_layers": 48, "hidden_size": 2048, "ffn_hidden_size": 6144, "num_attention_heads": 32,
        "num_query_groups": 4, "kv_channels": 128, "seq_length": 4096, "max_position_embeddings": 40960,
        "vocab_size": 151936, "norm_epsilon": 1e-6, "rotary_base": 1000000.0, "qk_layernorm": True,
        "num_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 768, "moe_aux_loss_coeff": 0.001,
    },
    "qwen1.5-moe-a2.7b": {  # qwen2_moe: 60 experts, 4 per token from a softmax over all, a gated shared expert
        **_LLAMA, "num_layers": 24, "hidden_size": 2048, "ffn_hidden_size": 5632, "num_attention_heads": 16,
        "num_query_groups": 16, "seq_length": 8192, "max_position_embeddings": 8192, "vocab_size": 151936,
        "norm_epsilon": 1e-6, "rotary_base": 1000000.0, "add_qkv_bias": True, "num_experts": 60,
        "moe_router_topk": 4, "moe_ffn_hidden_size": 1408, "moe_router_pre_softmax": True,
        "moe_shared_expert_intermediate_size": 5632, "moe_shared_expert_gate": True, "moe_aux_loss_coeff": 0.001,
    },
    # DeepSeek-V3 (arXiv 2412.19437, and deepseek-ai/DeepSeek-V3's config.json): multi-latent attention with YaRN
    # (factor 40 over a 4K context), 3 dense layers then 58 MoE layers of 256 sigmoid-routed experts, 8 per token
    # from 4 of 8 groups, with an expert bias and a shared expert. Published: 671B parameters, 37B activated per
    # token; the preset's checkpoint holds 671,026,419,200 (transformers' count of that config.json, expert
    # biases included) and 37.6B are activated (embeddings included). The MTP module is not part of the preset.
    "deepseek-v3": {
        **_DEEPSEEK_V3, "num_layers": 61, "hidden_size": 7168, "ffn_hidden_size": 18432, "num_attention_heads": 128,
        "seq_length": 4096, "max_position_embeddings": 163840, "vocab_size": 129280, "norm_epsilon": 1e-6,
        "rotary_base": 10000.0, "q_lora_rank": 1536, "kv_lora_rank": 512, "rotary_scaling_factor": 40.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "yarn_original_max_position_embeddings": 4096, "num_experts": 256,
        "moe_router_topk": 8, "moe_ffn_hidden_size": 2048, "moe_layer_freq": "([0]*3+[1]*58)",
        "moe_shared_expert_intermediate_size": 2048, "moe_router_topk_scaling_factor": 2.5,
        "moe_router_num_groups": 8, "moe_router_group_topk": 4,
    },
    # Moonlight-16B-A3B (arXiv 2502.16982, moonshotai/Moonlight-16B-A3B): DeepSeek-V3's architecture without a
    # query latent or YaRN, 1 dense layer then 26 MoE layers of 64 experts, 6 per token, 2 shared. Published:
    # 15.29B parameters, 2.24B activated, both without the embeddings (16B with them: 15,960,110,208).
    "moonlight-16b": {
        **_DEEPSEEK_V3, "num_layers": 27, "hidden_size": 2048, "ffn_hidden_size": 11264, "num_attention_heads": 16,
        "seq_length": 8192, "max_position_embeddings": 8192, "vocab_size": 163840, "norm_epsilon": 1e-5,
        "rotary_base": 50000.0, "kv_lora_rank": 512, "num_experts": 64, "moe_router_topk": 6,
        "moe_ffn_hidden_size": 1408, "moe_layer_freq": "([0]*1+[1]*26)", "moe_shared_expert_intermediate_size": 2816,
        "moe_router_topk_scaling_factor": 2.446,
    },
    # Qwen/Qwen3-Next-80B-A3B's config.json: 48 layers, 512 experts, 10 per token. Published: 80B parameters, 3B
    # activated; the preset holds 79,674,391,296 (transformers' count of that config), 3.87B activated.
    "qwen3-next-80b-a3b": {
        **_QWEN3_NEXT, **_QWEN3_NEXT_MOE, "num_layers": 48, "hidden_size": 2048, "ffn_hidden_size": 5120,
        "num_query_groups": 2, "vocab_size": 151936, "num_experts": 512, "moe_router_topk": 10,
    },
    # Qwen/Qwen3.5-9B's text model (its vision tower is not part of the preset): 32 dense layers. 8,953,803,264
    # parameters (transformers' count of its text config).
    "qwen3.5-9b": {
        **_QWEN3_NEXT, "num_layers": 32, "hidden_size": 4096, "ffn_hidden_size": 12288, "num_query_groups": 4,
        "vocab_size": 248320,
    },
    # Qwen/Qwen3.5-35B-A3B's text model: 40 layers of 256 experts, 8 per token. 34,660,610,688 parameters
    # (transformers' count of its text config), 3.45B activated.
    "qwen3.5-35b-a3b": {
        **_QWEN3_NEXT, **_QWEN3_NEXT_MOE, "num_layers": 40, "hidden_size": 2048, "ffn_hidden_size": 512,
        "num_query_groups": 2, "vocab_size": 248320, "num_experts": 256, "moe_router_topk": 8,
    },
    # openai/gpt-oss-20b's config.json: 24 layers of 32 experts. 20,914,757,184 parameters (transformers' count of
    # that config; published: 21B), 4.19B activated with both vocabulary tables, 3.61B without the input embedding
    # (published: 3.6B).
    "gpt-oss-20b": {**_GPT_OSS, "num_layers": 24, "num_experts": 32},
    # openai/gpt-oss-120b's config.json: 36 layers of 128 experts. 116,829,156,672 parameters (published: 117B),
    # 5.71B activated, 5.13B without the input embedding (published: 5.1B).
    "gpt-oss-120b": {**_GPT_OSS, "num_layers": 36, "num_experts": 128},
    # nvidia/Nemotron-H-8B-Base-8K: 52 sublayers, 24 Mamba-2, 4 attention (no RoPE), 24 squared-ReLU MLPs.
    # 8,100,852,736 parameters (transformers' count of its config.json).
    "nemotron-h-8b": {
        **_NEMOTRON, "hybrid_layer_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "hidden_size": 4096, "ffn_hidden_size": 21504, "num_query_groups": 8, "mamba_num_heads": 128,
        "seq_length": 8192, "max_position_embeddings": 8192,
    },
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B: 52 sublayers, 23 Mamba-2, 6 attention, 23 MoE layers of 128
    # squared-ReLU experts (6 per token, sigmoid-routed with an expert bias) and a shared expert. Published: 31.6B
    # parameters, 3.2B activated (3.6B with the embeddings).
    "nemotron-3-nano-30b-a3b": {
        **_NEMOTRON, "hybrid_layer_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "hidden_size": 2688, "ffn_hidden_size": 1856, "num_query_groups": 2, "mamba_num_heads": 64,
        "seq_length": 8192, "max_position_embeddings": 262144, "num_experts": 128, "moe_router_topk": 6,
        "moe_ffn_hidden_size": 1856, "moe_shared_expert_intermediate_size": 3712,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": 2.5,
    },
    # nvidia/NVIDIA-Nemotron-3-Super-120B-A12B's config.json: 88 sublayers, 40 Mamba-2, 8 attention, 40 latent MoE
    # layers of 512 squared-ReLU experts (22 per token) working in a 1,024 latent beside a shared expert of 5,376;
    # and the one MTP depth its files hold, an attention and an MoE sublayer (/*E), its loss weighted 0.3 as in
    # Megatron-Bridge's recipe (which runs the depth twice with shared weights, --mtp-use-repeated-layer, not built
    # here). 123,611,012,096 parameters, 120,668,687,360 without the MTP depth (published: 120B total, 12B
    # activated; 12.2B here without the input embedding and the MTP depth).
    "nemotron-3-super-120b-a12b": {
        **_NEMOTRON, "hybrid_layer_pattern": "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*"
                                             "EMEMEMEM*EMEMEMEME/*E",
        "hidden_size": 4096, "ffn_hidden_size": 2688, "num_query_groups": 2, "mamba_num_heads": 128,
        "seq_length": 8192, "max_position_embeddings": 262144, "num_experts": 512, "moe_router_topk": 22,
        "moe_ffn_hidden_size": 2688, "moe_shared_expert_intermediate_size": 5376, "moe_latent_size": 1024,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_topk_scaling_factor": 5.0, "mtp_loss_scaling_factor": 0.3,
    },
    "mixtral-tiny": {
        **_LLAMA, "num_layers": 4, "hidden_size": 128, "ffn_hidden_size": 256, "num_attention_heads": 4,
        "num_query_groups": 2, "seq_length": 128, "max_position_embeddings": 128, "vocab_size": 1024,
        "num_experts": 8, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
    },
}
