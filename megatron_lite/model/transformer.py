"""Pre-norm transformer layers and the block of consecutive layers one model chunk holds."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.config.layer_specs import layer_spec
from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.fp8 import FP8Recipe
from megatron_lite.model.kinds import MIXERS, MLPS, LayerParts
from megatron_lite.model.normalization import apply_norm
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.parallel.random import RNGTracker, checkpoint
from megatron_lite.parallel.state import ParallelState


class Norm(torch.nn.Module):
    """LayerNorm (GPT-2) or RMSNorm (Llama), zero-centred with --apply-layernorm-1p (model/normalization.py).
    Replicated on every TP rank; under sequence parallelism it sees only this rank's sequence slice, so its
    gradient is a partial sum over TP."""

    def __init__(self, config: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.kind = config.normalization
        self.eps = config.norm_epsilon
        self.zero_centered = config.apply_layernorm_1p
        h = config.hidden_size
        self.weight = new_parameter(ShardSpec((h,), init="zeros" if self.zero_centered else "ones",
                                              sequence_parallel=sequence_parallel), 1)
        self.bias = (new_parameter(ShardSpec((h,), init="zeros", sequence_parallel=sequence_parallel), 1)
                     if self.kind == "LayerNorm" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm(x, self.kind, self.weight, self.bias, self.eps, self.zero_centered)


class HiddenDropout(torch.nn.Module):
    """Dropout on the residual stream: the same mask on every TP rank, unless the stream is split along
    the sequence (sequence parallelism), where each rank's slice needs its own mask."""

    def __init__(self, p: float, rng_tracker: RNGTracker | None, sequence_parallel: bool):
        super().__init__()
        self.p = p
        self.rng_tracker = rng_tracker if sequence_parallel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.rng_tracker is None:
            return F.dropout(x, self.p, training=True)
        return self._dropout_on_tensor_parallel_stream(x)

    @torch.compiler.disable  # swapping the generator's state cannot be traced: eager under --torch-compile
    def _dropout_on_tensor_parallel_stream(self, x: torch.Tensor) -> torch.Tensor:
        with self.rng_tracker.fork():
            return F.dropout(x, self.p, training=True)


class TransformerLayer(torch.nn.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)). `layer_number` is the global index (0-based). The token mixer (softmax
    or multi-latent attention, Gated DeltaNet) and the MLP (dense or MoE) are the layer's spec's
    (config/layer_specs.py), built by the tables of model/kinds/.

    With --fp8-format the linears of attention and of a dense MLP compute in FP8 (model/fp8.py), unless
    --first-last-layers-bf16 keeps this layer out; an MoE layer's experts, shared experts and router do not.

    With --torch-compile, residual_blocks runs as a torch.compile graph. Every layer compiles the same code
    with the same guards, so dynamo compiles the dense layer once and every other dense layer reuses that
    graph (MoE layers share a second set). What cannot be traced, or is not compiled right by every torch we
    support, runs eagerly at a graph break, computing what eager mode computes: the tensor- and
    sequence-parallel collectives (parallel/mappings.py), the MoE part (`_mlp`), dropout on the
    tensor-parallel random stream (the core attention when it has dropout; hidden dropout under sequence
    parallelism), whose generator swap dynamo does not trace, and the recomputed core attention of
    --recompute-granularity selective, whose random-state replay is Python state.
    Full recomputation checkpoints the compiled layer from outside.
    Random ops draw from torch's generators as in eager mode (inductor's fallback_random), so dropout masks,
    the RNG tracker's streams and their replay under recomputation are eager's; otherwise inductor would
    draw masks of its own.
    """

    def __init__(self, config: ModelConfig, pstate: ParallelState, layer_number: int, *,
                 sequence_parallel: bool, attention_backend: str, rng_tracker: RNGTracker | None,
                 cp_comm_type: str = "p2p"):
        super().__init__()
        self.layer_number = layer_number
        spec = layer_spec(config, layer_number)
        parts = LayerParts(sequence_parallel, attention_backend, rng_tracker, cp_comm_type,
                           FP8Recipe.for_layer(config, layer_number))
        self.input_layernorm = Norm(config, sequence_parallel)
        self.self_attention = MIXERS[spec.mixer].build(config, pstate, layer_number, spec, parts)
        mlp = MLPS[spec.mlp]
        self.pre_mlp_layernorm = Norm(config, sequence_parallel) if mlp.normed else None
        self.mlp = mlp.build(config, pstate, layer_number, spec, parts)
        self.dropout = HiddenDropout(config.hidden_dropout, rng_tracker, sequence_parallel)
        self.compiled_residual_blocks = (torch.compile(self.residual_blocks, options={"fallback_random": True})
                                         if config.torch_compile else None)

    def forward(self, x: torch.Tensor, rotary, inference_params=None) -> torch.Tensor:
        if inference_params is not None:  # generation: the caches are Python state, so always eager
            recurrent = getattr(self.self_attention, "keeps_recurrent_state", False)
            return self.residual_blocks(x, rotary, inference_params.layer_cache(self.layer_number, recurrent))
        return (self.compiled_residual_blocks or self.residual_blocks)(x, rotary)

    def residual_blocks(self, x: torch.Tensor, rotary, kv_cache=None) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), rotary, kv_cache))
        if self.mlp is None:  # a mixer alone (a Mamba-2 layer of Nemotron-H)
            return x
        return x + self.dropout(self._mlp(self.pre_mlp_layernorm(x)))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP, or an MoE layer called outside any torch.compile graph: its token dispatch sizes
        tensors by routing counts read on the host (.tolist()) and it keeps statistics in Python."""
        return _run_eagerly(self.mlp, x) if getattr(self.mlp, "runs_eagerly", False) else self.mlp(x)



@torch.compiler.disable
def _run_eagerly(module: torch.nn.Module, *args):
    """`module(*args)`; under torch.compile dynamo breaks the graph here and runs the call eagerly."""
    return module(*args)


class TransformerBlock(torch.nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of the decoder, plus the final norm on the last
    pipeline stage. Holds the full-recomputation policy. With --torch-compile each layer is compiled on its
    own (as torchtitan does, so that compile time does not grow with depth); the rest stays eager."""

    def __init__(self, layers: list[TransformerLayer], config: ModelConfig, *, final_norm: bool,
                 sequence_parallel: bool, rng_tracker: RNGTracker | None):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.final_layernorm = Norm(config, sequence_parallel) if final_norm else None
        self.rng_tracker = rng_tracker
        self.recompute_units = (full_recompute_units(config.recompute_method, config.recompute_num_layers, len(layers))
                                if config.recompute_granularity == "full" else [])

    def forward(self, x: torch.Tensor, rotary, inference_params=None) -> torch.Tensor:
        if self.training and self.recompute_units:
            x = self._checkpointed_forward(x, rotary)
        else:
            for layer in self.layers:
                x = layer(x, rotary, inference_params)
        return self.final_layernorm(x) if self.final_layernorm is not None else x

    def _checkpointed_forward(self, x: torch.Tensor, rotary) -> torch.Tensor:
        """Full recomputation: each recomputed unit keeps only its input, and reruns its layers in backward."""
        for layers, recompute in self.recompute_units:
            run = _LayerRun(self.layers[layers])
            x = checkpoint(run, self.rng_tracker, x, rotary) if recompute else run(x, rotary)
        return x


class _LayerRun:
    """Consecutive layers called as one function, the unit that full recomputation checkpoints."""

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x: torch.Tensor, rotary) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, rotary)
        return x


def full_recompute_units(method: str | None, num_layers: int | None, chunk_layers: int) -> list[tuple[slice, bool]]:
    """(layers, recomputed) units of a model chunk of `chunk_layers` layers under --recompute-granularity full,
    with Megatron's --recompute-method meanings: uniform checkpoints all layers in groups of `num_layers`
    (the last group may be shorter); block checkpoints the first `num_layers` layers one by one and keeps the
    rest's activations. Without a method: block, over every layer when `num_layers` is unset."""
    if method == "uniform":
        return [(slice(start, start + num_layers), True) for start in range(0, chunk_layers, num_layers)]
    recomputed = num_layers if num_layers is not None else chunk_layers
    return [(slice(index, index + 1), index < recomputed) for index in range(chunk_layers)]
