"""Random-number streams for dropout: one shared by all TP ranks, one different on each TP rank.

Dropout on a tensor that every TP rank holds whole (the residual stream without sequence parallelism)
must draw the same mask on every TP rank, or the replicas drift apart; dropout on a tensor split across
TP ranks (attention probabilities of this rank's heads, the residual stream's sequence slice with
sequence parallelism) must draw different masks, or the split masks repeat. The default torch generator
serves the first case; `RNGTracker.fork()` swaps in a per-TP-rank stream for the second, as Megatron's
CUDA RNG tracker does. Seeds follow Megatron: seed + 100 * pp_rank for the default stream (set once, by
`set_random_seed`), seed + 2718 + tp_rank on top of that for the tensor-parallel stream. A rank holding
several model chunks (virtual pipeline stages) has one tracker per chunk, or every chunk would repeat the
first one's masks: the chunk's first global layer enters the seed shifted by 20 bits, which keeps every
(stage, TP rank, chunk) stream distinct within the 32 bits the CPU generator uses.
"""

from __future__ import annotations

import contextlib

import torch

_TENSOR_PARALLEL_SEED_OFFSET = 2718


def _device_rng(device: torch.device):
    return torch.cuda if device.type == "cuda" else torch.random


def set_random_seed(seed: int, pp_rank: int) -> None:
    """Seed torch's default generators (the CPU's and every GPU's) for this pipeline stage: every rank of
    one stage draws the same default stream, the stages different ones."""
    torch.manual_seed(seed + 100 * pp_rank)


class RNGTracker:
    """Holds the tensor-parallel random stream and swaps it in around dropout in split regions. Building one
    leaves torch's default generators as they were."""

    def __init__(self, seed: int, tp_rank: int, pp_rank: int, device: torch.device, layer_offset: int = 0):
        self.device = device
        generator = torch.Generator(device) if device.type == "cuda" else torch.Generator()
        generator.manual_seed(seed + 100 * pp_rank + _TENSOR_PARALLEL_SEED_OFFSET + tp_rank + (layer_offset << 20))
        self.state = generator.get_state()

    @contextlib.contextmanager
    def fork(self):
        """Run the enclosed block on the tensor-parallel stream, then return to the default one."""
        rng = _device_rng(self.device)
        outer = rng.get_rng_state()
        rng.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = rng.get_rng_state()
            rng.set_rng_state(outer)


def checkpoint(function, rng_tracker: RNGTracker | None, *args):
    """Activation recomputation that replays the same dropout masks on both random streams.

    torch.utils.checkpoint restores the default generator before recomputing; the tracker's
    tensor-parallel stream is restored here, and put back afterwards so later layers are unaffected.
    """
    start_state = rng_tracker.state if rng_tracker is not None else None
    calls = []

    def run(*inputs):
        if rng_tracker is None or not calls:  # the first call is the forward pass itself
            calls.append(True)
            return function(*inputs)
        outer_state = rng_tracker.state
        rng_tracker.state = start_state
        try:
            return function(*inputs)
        finally:
            rng_tracker.state = outer_state

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
