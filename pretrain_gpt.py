"""Pretrain a GPT or Llama model: `torchrun --nproc-per-node N pretrain_gpt.py <flags>` (see --help).

As in Megatron-LM, this file only says what the model is, how a micro-batch is read and what the
loss is; megatron_lite.training.loop.pretrain does the rest. The model and training modules are imported
inside the functions that use them: the configuration is validated first, without loading torch, so a
bad command line fails on every rank in a fraction of a second.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from functools import partial
from typing import TYPE_CHECKING

from megatron_lite.config.arguments import ConfigError, parse_config
from megatron_lite.config.sections import Config
from megatron_lite.errors import UserError, debug_requested, report
from megatron_lite.parallel.launcher import adopt_slurm_environment, exit_with_launcher, warn_of_restart_hazard

if TYPE_CHECKING:
    import torch

    from megatron_lite.config.layer_split import ChunkPlan
    from megatron_lite.model.gpt import GPTModel
    from megatron_lite.parallel.state import ParallelState


def model_provider(config: Config, pstate: ParallelState, plan: ChunkPlan, device: torch.device) -> GPTModel:
    """One model chunk: the layers of `plan`, with the embedding / output layer where the plan says
    (megatron_lite/model/provider.py builds it as evaluation, generation and conversion do)."""
    from megatron_lite.model.provider import build_model_chunk

    return build_model_chunk(config, pstate, plan, device)


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Sum of the per-token losses over unmasked tokens, their count, and what to report."""
    loss_sum = (per_token_loss.float() * loss_mask).sum()
    num_tokens = loss_mask.sum()
    return loss_sum, num_tokens, {"lm loss": (loss_sum.detach(), num_tokens.detach())}


def forward_step(data_iterator, model):
    """Read one micro-batch (the same on every rank of the cp group), keep this cp rank's share of the
    sequence, and run it through this model chunk. The document ids of --reset-attention-mask stay on the
    host: attention plans its blocks from them there."""
    from megatron_lite.model.attention.context_parallel import get_batch_on_this_cp_rank

    pstate = model.pstate
    batch = get_batch_on_this_cp_rank(next(data_iterator), pstate)
    device = next(model.parameters()).device
    tokens, labels = batch["tokens"].to(device, non_blocking=True), batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    output = model(tokens, batch["position_ids"].to(device, non_blocking=True), labels=labels,
                   document_ids=batch.get("document_ids"), loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """Train as the command line `argv` (this process's when None) says; the exit status. `own_process`: the
    run is this process's only work (the script's entry, not a caller's function)."""
    debug = debug_requested(argv)
    try:
        adopt_slurm_environment(os.environ)  # before anything reads RANK, WORLD_SIZE or LOCAL_RANK
    except UserError as error:
        return _fail(error, debug, world_size=1, status=2)
    exit_with_launcher(os.environ)
    warn_of_restart_hazard(os.environ)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config = parse_config(argv, world_size)
    except ConfigError as error:
        return _fail(error, debug, world_size, status=2)
    from megatron_lite.parallel.lifecycle import as_peer_lost_error, as_timeout_error
    from megatron_lite.training.loop import pretrain

    if own_process:  # what start-up imported lives as long as the process: garbage collections need not traverse it
        gc.freeze()

    debug = debug or config.logging.debug
    try:
        downstream = None
        if config.training.eval_tasks:  # lm-eval on the live model at each evaluation; checked before any compute
            from megatron_lite.evaluation.in_training import DownstreamEvaluation

            downstream = DownstreamEvaluation(config)
        pretrain(config, model_provider, forward_step, downstream)
    except UserError as error:
        return _fail(error, debug, world_size, status=getattr(error, "exit_code", 1))
    except RuntimeError as error:  # a stuck or dead rank, when it is one
        known = as_timeout_error(error, config.training.distributed_timeout_minutes) or as_peer_lost_error(error)
        if known is None:
            raise
        return _fail(known, debug, world_size)
    return 0


def _fail(error: BaseException, debug: bool, world_size: int, status: int = 1) -> int:
    """Report `error` in one line and return the exit status. torchrun stops the other ranks at the first
    exit, so with several ranks wait a moment: the others, which usually found the same problem, report too."""
    report(error, debug)
    if world_size > 1:
        time.sleep(2.0)
    return status


if __name__ == "__main__":
    sys.exit(main(own_process=True))
