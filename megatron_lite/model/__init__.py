"""The model: GPTModel and its layers, each built for one rank's share of the parallel layout.

    gpt.py              GPTModel: embedding -> transformer layers -> final norm -> output layer and loss
    transformer.py      pre-norm transformer layers and the block one model chunk holds
    kinds/              every kind of token mixer and MLP: how a layer builds it, its FLOPs and saved bytes
    attention/          self-attention (GQA, RoPE, kernels), multi-latent attention, YaRN, context parallelism
    mlp.py              the dense feed-forward block
    moe/                Mixture-of-Experts: router, token dispatchers, experts
    mtp.py              multi-token prediction depths
    tensor_parallel.py  column/row-parallel linears, vocab-parallel embedding and cross-entropy
    fp8.py              FP8 GEMMs of the tensor-parallel linears
    sharding.py         how each parameter relates to its global tensor; layout-independent initialisation
    loss_scaling.py     how a micro-batch's losses are weighted in the backward
    contract.py         what the rest of the framework needs from a model chunk
    flops.py            model FLOPs per trained token (MFU)
"""
