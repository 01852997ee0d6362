"""The run's configuration: Megatron-LM flags -> a validated Config, without importing torch.

    sections.py           Config: one dataclass per section, each field a flag with its help text
    arguments.py          the command line and YAML (--config) read into a Config
    presets.py            --model-preset shapes
    flag_dependencies.py  which flags act only beside another, which exclude each other
    validation.py         every check before a process group exists, one line per problem
    *_validation.py       the checks of one feature: FP8, MLA, MoE layout, MTP, Muon
    schedules.py          the schedules' lengths in samples, and their checks
    layer_pattern.py      which layers are MoE layers (--moe-layer-freq)
    layer_split.py        which layers each pipeline stage (and virtual stage) holds
    muon_coefficients.py  Newton-Schulz coefficient sets and their step-count rules
"""
