"""Adam's state in a Megatron-LM torch_dist checkpoint, as this framework's optimizer state.

Megatron-Core's optimizer without the distributed optimizer (FP32Optimizer, Float16OptimizerWithFloat16Params)
saves its state in model space: `optimizer.state.exp_avg.<model key>`, `optimizer.state.exp_avg_sq.<model key>`
(and `optimizer.state.fp32_param.<model key>`, the fp32 master of a bf16/fp16 weight), each with the model
tensor's global shape (layers stacked alike), and the step count in common.pt (`optimizer.state.common_step`).
That is this framework's layout too (`optimizer.state.<kind>.<global name>`, checkpoint/checkpointing.py),
so each moment is read exactly where its weight is. The distributed optimizer's default `dp_reshardable`
format stores each data-parallel rank's flat buffers instead; it is not read: the model converts and the
run resumes with --no-load-optim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.megatron_lm.names import Source

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER = "fp32_param"


@dataclass
class OptimizerState:
    """Where each of our optimizer tensors lies (`sources`), and the plain values metadata.json records."""

    sources: dict[str, Source]
    values: dict


def optimizer_state(reader, model_sources: dict[str, Source], has_masters: bool) -> OptimizerState | str:
    """The optimizer state of `reader` for our model tensors (`model_sources`), or why it cannot be read.
    `has_masters`: our optimizer keeps fp32 masters of these weights (a bf16/fp16 run)."""
    if reader.format != "torch_dist":
        return "the torch format's optimizer state (torch.optim's own, by parameter index) is not read"
    kinds = (*MOMENTS, MASTER) if has_masters else MOMENTS
    sources, missing = {}, []
    for name, source in model_sources.items():
        for kind in kinds:
            key = f"optimizer.state.{kind}.{source.key}"
            if key in reader.shapes:
                sources[f"optimizer.state.{kind}.{name}"] = Source(key, source.index)
            else:
                missing.append(key)
    if missing:
        found = sorted(key for key in reader.shapes if key.startswith("optimizer."))
        what = f"its optimizer tensors are {found[0]}, ..." if found else "it holds no optimizer state"
        return f"no '{missing[0]}': {what} (the distributed optimizer's dp_reshardable format is not read)"
    step = reader.saved.get("optimizer", {}).get("state", {}).get("common_step")
    if step is None:
        return "common.pt records no optimizer step count (optimizer.state.common_step)"
    step = int(step.item() if isinstance(step, torch.Tensor) else step)
    return OptimizerState(sources, {"optimizer.step": step, "optimizer.grad_scaler": None})
