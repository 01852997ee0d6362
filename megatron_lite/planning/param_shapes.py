"""The parameters one rank's model chunk holds, as shapes, read off the model itself: each distinct kind of layer,
and a chunk's embedding, final norm, output layer and multi-token prediction modules, are built once per layout on
the meta device (nothing allocated, no process group) and their local parameters listed in `module.parameters()`
order, so the planner counts exactly what training builds, for any layer kind the model has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_lite.config.layer_specs import LayerSpec, layer_specs
from megatron_lite.config.layer_split import ChunkPlan
from megatron_lite.config.sections import Config
from megatron_lite.model.attention.self_attention import choose_attention_backend
from megatron_lite.model.kinds.activation_terms import expert_tensor_parallel_size
from megatron_lite.model.provider import build_model_chunk
from megatron_lite.model.sharding import initialization_skipped
from megatron_lite.model.transformer import TransformerLayer
from megatron_lite.optim.muon_optimizer import uses_muon
from megatron_lite.parallel.state import Layout, ParallelState
from megatron_lite.planning.shared_cache import shapes_key, shared

_META = torch.device("meta")


@dataclass(frozen=True)
class ParamShape:
    """One local parameter as the gradient buffers see it."""

    numel: int
    expert: bool = False
    unit: int = -1  # ZeRO-3 gathering unit: the chunk-local layer index, -1 for the rest of the chunk
    isolated: bool = False  # the tied-embedding copy that the first and last stage keep equal
    muon: bool = False  # a hidden weight matrix, which --optimizer muon steps (optim/muon_optimizer.py)


def _first_rank(config: Config) -> ParallelState:
    """Rank 0 of a layout with the run's TP, EP and expert TP (what a rank's shards depend on), without groups."""
    p, etp = config.parallel, expert_tensor_parallel_size(config)
    layout = Layout(tp=p.tensor_model_parallel_size, ep=p.expert_model_parallel_size, etp=etp,
                    dp=etp * p.expert_model_parallel_size)
    return ParallelState.without_groups(layout, 0)


def _listed(named_parameters, isolated: tuple = ()) -> list[ParamShape]:
    return [ParamShape(param.numel(), param.spec.expert, -1, any(param is other for other in isolated),
                       uses_muon(name, param)) for name, param in named_parameters]


def _layer_shapes(config: Config, spec: LayerSpec) -> list[ParamShape]:
    """The parameters of a TransformerLayer of `spec`, built as the first decoder layer of that spec."""
    def build() -> list[ParamShape]:
        number = layer_specs(config.model).index(spec)
        with _META, initialization_skipped():
            layer = TransformerLayer(config.model, _first_rank(config), number,
                                     sequence_parallel=config.parallel.sequence_parallel,
                                     attention_backend=choose_attention_backend("auto", _META), rng_tracker=None)
        return _listed(layer.named_parameters())

    return shared(("layer shapes", shapes_key(config), spec), build)


def layer_numels(config: Config, spec: LayerSpec) -> tuple[list[int], list[int]]:
    """One TransformerLayer's element counts in registration order: the dense parameters and the routed experts'."""
    shapes = _layer_shapes(config, spec)
    return [p.numel for p in shapes if not p.expert], [p.numel for p in shapes if p.expert]


def _layer_params(config: Config, spec: LayerSpec, unit: int) -> list[ParamShape]:
    return [ParamShape(p.numel, p.expert, unit, p.isolated, p.muon) for p in _layer_shapes(config, spec)]


def _ends(config: Config, chunk: ChunkPlan) -> tuple[list[ParamShape], list[ParamShape]]:
    """A chunk's parameters before its layers (the embedding on the first stage, and the copies of its tables the
    last stage keeps for multi-token prediction) and after them (on the last stage the final norm, the output layer
    unless tied to this stage's table, the multi-token prediction modules), from the chunk built without layers."""
    def build() -> tuple[list[ParamShape], list[ParamShape]]:
        with initialization_skipped():
            model = build_model_chunk(config, _first_rank(config), ChunkPlan(chunk.layer_offset, 0, chunk.pre_process,
                                                                             chunk.post_process), _META)
        isolated = tuple(model.shared_embedding_parameters())
        named = list(model.named_parameters())
        front = [(name, param) for name, param in named if name.startswith("embedding.")]
        return _listed(front, isolated), _listed(named[len(front):], isolated)

    key = ("chunk ends", shapes_key(config), chunk.pre_process, chunk.post_process)
    return shared(key, build)


def front_params(config: Config, chunk: ChunkPlan) -> list[ParamShape]:
    return _ends(config, chunk)[0]


def back_params(config: Config, chunk: ChunkPlan) -> list[ParamShape]:
    return _ends(config, chunk)[1]


def chunk_params(config: Config, chunk: ChunkPlan) -> list[ParamShape]:
    """A GPTModel chunk's parameters in `module.parameters()` order."""
    params = front_params(config, chunk)
    for index, spec in enumerate(chunk_layer_specs(config, chunk)):
        params += _layer_params(config, spec, index)
    return params + back_params(config, chunk)


def chunk_layer_specs(config: Config, chunk: ChunkPlan) -> list[LayerSpec]:
    """The spec of each layer of the chunk."""
    return layer_specs(config.model)[chunk.layer_offset:chunk.layer_offset + chunk.num_layers]


def chunk_numels(config: Config, chunk: ChunkPlan) -> tuple[int, int]:
    """(dense, routed expert) parameter elements of a chunk, each layer spec counted once."""
    def count() -> tuple[int, int]:
        specs = chunk_layer_specs(config, chunk)
        ends = front_params(config, chunk) + back_params(config, chunk)
        dense = sum(param.numel for param in ends if not param.expert)
        expert = sum(param.numel for param in ends if param.expert)
        for spec in set(specs):
            layers = specs.count(spec)
            layer_dense, layer_expert = layer_numels(config, spec)
            dense, expert = dense + layers * sum(layer_dense), expert + layers * sum(layer_expert)
        return dense, expert

    key = ("chunk numels", shapes_key(config), chunk.layer_offset, chunk.num_layers, chunk.pre_process,
           chunk.post_process)
    return shared(key, count)
