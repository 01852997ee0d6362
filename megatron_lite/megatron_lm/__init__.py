"""Megatron-LM interchange: its checkpoints read (torch_dist and torch formats) and written (torch_dist).

    pickles.py       common.pt / model_optim_rng.pt read with weights_only=True and an allow-list
    arguments.py     the checkpoint's saved Megatron flags <-> this framework's flags
    names.py         Megatron-Core's checkpoint keys (stacked layers and experts, fused norms) <-> ours
    checkpoint.py    Megatron-LM checkpoint directories: the iteration, the torch_dist reader
    legacy_torch.py  the per-rank torch format's reader (TP shards joined, pipeline stages renumbered)
    optimizer_state.py  Adam's moments saved in model space, as this framework's optimizer state
    convert.py       both conversions, a layer at a time

tools/convert_checkpoint.py drives these (--direction megatron-to-mlite / mlite-to-megatron).
"""
