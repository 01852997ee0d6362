"""How the decoder's layers are split over the pipeline stages and, when interleaved, over each stage's model
chunks. Free of torch: validation.py checks a layout with it before torch is imported; the training loop and the
layout planner (planning/) take the model chunks from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


def pipeline_stage_layers(config: Config) -> list[int]:
    """Number of layers on each pipeline stage (before virtual-stage interleaving)."""
    m, p = config.model, config.parallel
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

    With v chunks per stage, each stage's layers are split evenly among its chunks (Megatron's rule, uneven
    first and last stages included): with L[p] = layers of stage p / v, chunk c of stage p holds L[p] layers
    starting at c * sum(L) + sum(L[:p]), so micro-batches flow 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ... .
    """
    pp = config.parallel.pipeline_model_parallel_size
    chunks = config.virtual_pipeline_stages or 1
    per_chunk = [count // chunks for count in pipeline_stage_layers(config)]
    return [ChunkPlan(c * sum(per_chunk) + sum(per_chunk[:pp_rank]), per_chunk[pp_rank],
                      c == 0 and pp_rank == 0, c == chunks - 1 and pp_rank == pp - 1) for c in range(chunks)]
