"""After the last micro-batch's backward: make every rank's gradients those of the global batch's loss.

1. Data parallel: each chunk's buckets are reduced over dp x cp (expert buckets over expert dp); with a
   sharded strategy each rank holds the reduced gradients of its shard only, and steps 2-4 work on those
   (every rank of a TP group, and the first and last stage, hold the same ranges of the same parameters).
2. Sequence parallel: replicated parameters that saw only a sequence slice (norms, row-parallel biases,
   learned positions) hold partial gradients; they are summed over TP.
3. Tied embeddings split over pipeline stages: the first and last stage add their gradients.
4. Loss normalisation (model/loss_scaling.py), as Megatron's: for the per-micro-batch mean (no token count
   given) every gradient is divided by dp x cp, its DDP average over the ranks the micro-batches came from;
   with --calculate-per-token-loss the token count of the global batch (known on the last stage) is
   broadcast over the pipeline and summed over dp x cp, and every gradient is divided by it (at least 1).
"""

from __future__ import annotations

import torch

from megatron_lite.optim.data_parallel import DistributedDataParallel
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


def _all_reduce_grads(grads: list[torch.Tensor], group) -> None:
    """Sum 1-D gradient views over `group` with one collective."""
    if group is None or not grads:
        return
    flat = torch.cat(grads)
    mappings.all_reduce(flat, group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()])
        offset += grad.numel()


def global_token_count(local_tokens: torch.Tensor, pstate: ParallelState) -> torch.Tensor:
    """Tokens of the global batch: the last stage's count, shared over the pipeline, summed over dp x cp."""
    count = local_tokens.detach().clone().double()
    mappings.broadcast(count, pstate.pp_ranks[-1], pstate.group("pp"))
    return mappings.all_reduce(count, pstate.group("dp_cp"))


def finalize_model_grads(model_chunks: list[DistributedDataParallel], pstate: ParallelState,
                         local_tokens: torch.Tensor | None) -> None:
    """Reduce and normalise the gradients of all chunks: divided by the global token count of
    `local_tokens` (--calculate-per-token-loss, the schedule's count), or by dp x cp when it is None."""
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    sequence_parallel = [g for chunk in model_chunks for g in chunk.main_grad_shards(
        p for p in chunk.module.parameters() if p.requires_grad and p.spec.sequence_parallel)]
    _all_reduce_grads(sequence_parallel, pstate.group("tp"))
    shared = [g for chunk in model_chunks for g in chunk.main_grad_shards(chunk.module.shared_embedding_parameters())]
    _all_reduce_grads(shared, pstate.group("embedding"))
    if local_tokens is None:
        factor = 1.0 / (pstate.dp_size * pstate.cp_size)
    else:
        factor = global_token_count(local_tokens, pstate).clamp(min=1.0).reciprocal()
    for chunk in model_chunks:
        chunk.scale_gradients(factor)
