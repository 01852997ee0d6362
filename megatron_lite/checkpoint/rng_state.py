"""Random generator states: what a rank draws from, saved per rank and restored only in the same layout.

Dropout draws from torch's default generator (CPU, and CUDA on GPUs) and from each model chunk's
tensor-parallel stream (parallel/random.py). Their states belong to one rank of one layout: a rank of
another layout (other TP/PP/DP coordinates) draws different masks anyway, so the states are keyed by
`layout_tag` and skipped when it differs.
"""

from __future__ import annotations

import torch

from megatron_lite.config.sections import Config


def layout_tag(config: Config, device: torch.device) -> str:
    """Which generator states a rank has: they only carry over to the same ranks of the same layout."""
    p = config.parallel
    return (f"tp{p.tensor_model_parallel_size}_cp{p.context_parallel_size}_dp{p.data_parallel_size}_"
            f"pp{p.pipeline_model_parallel_size}_ep{p.expert_model_parallel_size}_"
            f"vp{config.virtual_pipeline_stages or 0}_{device.type}")


def _rng_trackers(model: list) -> list:
    """Every chunk's trackers (model/contract.py), in chunk order."""
    return [tracker for chunk in model for tracker in chunk.rng_trackers()]


def rng_states(model: list, device: torch.device) -> dict[str, torch.Tensor]:
    """Every random generator the run draws from: torch's default (CPU and GPU) and each chunk's
    tensor-parallel stream."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    for index, tracker in enumerate(_rng_trackers(model)):
        states[f"tracker_{index}"] = tracker.state
    return states


def set_rng_states(model: list, device: torch.device, states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    for index, tracker in enumerate(_rng_trackers(model)):
        tracker.state = states[f"tracker_{index}"].clone()
