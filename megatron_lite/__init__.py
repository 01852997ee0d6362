"""megatron_lite: Megatron-style LLM pretraining on PyTorch. Packages, in the order they build on each other
(a module imports only from its own layer or one listed above it; tests/test_package_layout.py checks it):

    errors.py, files.py, tool_args.py   user errors, side files and write probes, tool argument types
    data/         corpora -> tokens in .bin/.idx files -> training samples
    config/       the flags: parsing, presets, validation before any process group exists
    parallel/     process groups, rank layout, autograd collectives, pipeline point-to-point
    model/        GPTModel and its layers (attention/, moe/, MLP, MTP, FP8, tensor-parallel linears)
    pipeline/     micro-batch schedules over the pipeline stages
    optim/        data parallelism, ZeRO, Adam and Muon, loss scaling, schedules
    checkpoint/   sharded, layout-independent checkpoints
    hf/           Hugging Face conversion both ways
    planning/     per-rank memory and step time predicted before a launch
    training/     the training loop, its logging, profiling and rerun checks
    inference/    generation with a KV cache
"""
