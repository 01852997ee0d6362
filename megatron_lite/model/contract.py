"""What the rest of megatron_lite needs from a model chunk, and the check that a module provides it.

The optimizer, checkpointing, the pipeline schedules and the training loop never import a model class:
they work with any module that has the methods of `ModelChunk` and a `ShardSpec` (model/sharding.py) on
every parameter, which says how the local tensor relates to the global one. GPTModel is one such module;
a new model family is another. `check_model_chunk` runs when a chunk is wrapped for data parallelism, so a
module that lacks part of the contract fails there, by name, rather than deep inside a training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from megatron_lite.model.sharding import ShardSpec
from megatron_lite.parallel.random import RNGTracker
from megatron_lite.parallel.state import ParallelState


class TrainingHooks(Protocol):
    """What a model adds to each training step besides its language-model loss. Each method takes all of this
    rank's chunks of the model; those that reduce over ranks are collectives every rank calls at the same step."""

    def step_losses(self, model_chunks) -> dict[str, torch.Tensor]:
        """The auxiliary losses of the step just run, by name: 0-dim tensors equal on every rank, which the rerun
        machine checks as it checks the language-model loss (resets what they were summed from)."""

    def step_metrics(self, losses: dict[str, float]) -> dict:
        """The figures to log for the step from the values of `step_losses`."""

    def after_step(self, model_chunks) -> None:
        """Updates after the optimizer step that are not gradient steps (the MoE routers' expert biases)."""

    def interval_metrics(self, model_chunks) -> dict:
        """The figures to log once per log interval, over the interval (resets what they were summed from)."""

    def statistics(self, model_chunks) -> object:
        """A copy of what the model accumulates over steps, for `load_statistics` when an iteration runs again."""

    def load_statistics(self, model_chunks, saved: object) -> None:
        """Put back what `statistics` copied."""


class ModelChunk(Protocol):
    """One pipeline stage's share of a model (one of several with virtual pipeline stages)."""

    pstate: ParallelState

    def named_global_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(layout-independent name, parameter) for every parameter: the name is the checkpoint key and the
        seed of the parameter's initial value, so it must not depend on TP, PP, EP or virtual stages."""

    def shared_embedding_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters this chunk holds a copy of and another pipeline stage also holds (tied embeddings):
        their gradients are summed over the two stages so the copies stay equal."""

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """The previous pipeline stage's output, which a chunk without the embedding runs on."""

    def sharding_units(self) -> list[torch.nn.Module]:
        """Submodules whose parameters ZeRO-3 gathers together before the submodule runs and frees after it
        (transformer layers, in forward order); the chunk itself is the unit of every other parameter."""

    def rng_trackers(self) -> list[RNGTracker]:
        """The random streams the chunk draws dropout from besides torch's default generator; checkpoints
        save and restore their states."""

    def named_global_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(layout-independent name, buffer) for the state besides parameters that checkpoints carry (each
        with a ShardSpec; the MoE routers' expert biases): not trained by the optimizer, saved and loaded."""

    def training_hooks(self) -> TrainingHooks:
        """What the model adds to each training step (the same for every chunk of a model)."""


_METHODS = [name for name, value in vars(ModelChunk).items() if callable(value) and not name.startswith("_")]


def check_model_chunk(module: torch.nn.Module) -> None:
    """Raise TypeError naming what `module` lacks of the ModelChunk contract."""
    name = type(module).__name__
    missing = [method for method in _METHODS if not callable(getattr(module, method, None))]
    if not isinstance(getattr(module, "pstate", None), ParallelState):
        missing.append("pstate")
    if missing:
        raise TypeError(f"{name} is not a model chunk (megatron_lite/model/contract.py): it lacks "
                        f"{', '.join(missing)}")
    unspecified = [param_name for param_name, param in module.named_parameters()
                   if not isinstance(getattr(param, "spec", None), ShardSpec)]
    if unspecified:
        raise TypeError(f"{name}: parameters without a ShardSpec (model/sharding.new_parameter gives one): "
                        f"{', '.join(unspecified[:5])}{' ...' if len(unspecified) > 5 else ''}")
