"""How the decoder's layers are split over the pipeline stages and, when interleaved, over each stage's model
chunks. Free of torch: validation.py checks a layout with it before torch is imported; the training loop and the
layout planner (planning/) take the model chunks from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from megatron_lite.config.hybrid_layer_pattern import pattern_chunk_layers

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


def pipeline_stage_layers(config: Config) -> list[int]:
    """Number of layers on each pipeline stage (before virtual-stage interleaving)."""
    m, p = config.model, config.parallel
    from_pattern = pattern_chunk_layers(config)
    if from_pattern is not None:
        return [sum(stages) for stages in zip(*from_pattern)]
    pp = p.pipeline_model_parallel_size
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    middle_stages = pp - (first is not None) - (last is not None)
    remaining = m.num_layers - (first or 0) - (last or 0)
    per_middle = remaining // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


@dataclass
class ChunkPlan:
    """What one model chunk of this rank holds."""

    layer_offset: int
    num_layers: int
    pre_process: bool
    post_process: bool


def model_chunk_plans(config: Config, pp_rank: int) -> list[ChunkPlan]:
    """The layers of each of this stage's model chunks (several with the interleaved schedule).

    Chunk c of stage p holds the layers after those of every chunk before it in the order micro-batches flow,
    0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ... . --hybrid-layer-pattern's | segments give each chunk's
    layers; otherwise, with v chunks per stage, each stage's layers are split evenly among its chunks (Megatron's
    rule, uneven first and last stages included).
    """
    pp = config.parallel.pipeline_model_parallel_size
    counts = pattern_chunk_layers(config)
    if counts is None:
        chunks = config.virtual_pipeline_stages or 1
        counts = [[stage // chunks for stage in pipeline_stage_layers(config)]] * chunks
    flat = [count for chunk in counts for count in chunk]
    return [ChunkPlan(sum(flat[:c * pp + pp_rank]), counts[c][pp_rank], c == 0 and pp_rank == 0,
                      c == len(counts) - 1 and pp_rank == pp - 1) for c in range(len(counts))]
