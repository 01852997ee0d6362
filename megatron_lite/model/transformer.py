"""Pre-norm transformer layers and the block of consecutive layers one model chunk holds."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megatron_lite.config import ModelConfig
from megatron_lite.model.attention import SelfAttention
from megatron_lite.model.mlp import MLP
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.parallel.random import RNGTracker, checkpoint
from megatron_lite.parallel.state import ParallelState


class Norm(torch.nn.Module):
    """LayerNorm (GPT-2) or RMSNorm (Llama). Replicated on every TP rank; under sequence parallelism it
    sees only this rank's sequence slice, so its gradient is a partial sum over TP."""

    def __init__(self, config: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.kind = config.normalization
        self.eps = config.norm_epsilon
        h = config.hidden_size
        self.weight = new_parameter(ShardSpec((h,), init="ones", sequence_parallel=sequence_parallel), 1)
        self.bias = (new_parameter(ShardSpec((h,), init="zeros", sequence_parallel=sequence_parallel), 1)
                     if self.kind == "LayerNorm" else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "RMSNorm":
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


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
        with self.rng_tracker.fork() if self.rng_tracker is not None else contextlib.nullcontext():
            return F.dropout(x, self.p, training=True)


class TransformerLayer(torch.nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)). `layer_number` is the global index (0-based)."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, layer_number: int, *,
                 sequence_parallel: bool, attention_backend: str, rng_tracker: RNGTracker | None,
                 mlp: torch.nn.Module | None = None):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = Norm(config, sequence_parallel)
        self.self_attention = SelfAttention(config, pstate, sequence_parallel=sequence_parallel,
                                            backend=attention_backend, rng_tracker=rng_tracker)
        self.pre_mlp_layernorm = Norm(config, sequence_parallel)
        self.mlp = mlp if mlp is not None else MLP(config, pstate, sequence_parallel=sequence_parallel)
        self.dropout = HiddenDropout(config.hidden_dropout, rng_tracker, sequence_parallel)

    def forward(self, x: torch.Tensor, rotary, inference_params=None) -> torch.Tensor:
        kv_cache = inference_params.layer_cache(self.layer_number) if inference_params is not None else None
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), rotary, kv_cache))
        return x + self.dropout(self.mlp(self.pre_mlp_layernorm(x)))


class TransformerBlock(torch.nn.Module):
    """Layers [layer_offset, layer_offset + num_layers) of the decoder, plus the final norm on the last
    pipeline stage. Holds the activation-recomputation policy."""

    def __init__(self, layers: list[TransformerLayer], config: ModelConfig, *, final_norm: bool,
                 sequence_parallel: bool, rng_tracker: RNGTracker | None):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.final_layernorm = Norm(config, sequence_parallel) if final_norm else None
        self.rng_tracker = rng_tracker
        self.recompute_full_layers = 0
        if config.recompute_granularity == "full":
            self.recompute_full_layers = config.recompute_num_layers or len(layers)
        if config.recompute_granularity == "selective":
            for layer in layers:
                layer.self_attention.recompute_core_attention = True

    def forward(self, x: torch.Tensor, rotary, inference_params=None) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if self.training and index < self.recompute_full_layers:
                x = checkpoint(layer, self.rng_tracker, x, rotary)
            else:
                x = layer(x, rotary, inference_params)
        return self.final_layernorm(x) if self.final_layernorm is not None else x
