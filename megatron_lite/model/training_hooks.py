"""What a GPT model adds to each training step besides its language-model loss: the multi-token prediction
depths' losses (model/mtp.py) and the MoE layers' auxiliary losses, load statistics and expert-bias updates
(model/moe/layer.py). The training loop and the rerun machine reach them through the model contract
(`ModelChunk.training_hooks`, model/contract.py), so they name no model feature."""

from __future__ import annotations

import torch

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.moe.layer import (
    load_moe_statistics,
    moe_metrics,
    moe_statistics,
    moe_step_losses,
    update_expert_biases,
)
from megatron_lite.model.mtp import mtp_loss_totals
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


class GPTTrainingHooks:
    """The training hooks of a GPTModel of `config` at `pstate`'s layout (model/contract.py TrainingHooks)."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, sequence_parallel: bool):
        self.config, self.pstate, self.sequence_parallel = config, pstate, sequence_parallel

    @torch.no_grad()
    def step_losses(self, model_chunks) -> dict[str, torch.Tensor]:
        """Per multi-token prediction depth ("mtp <k> loss"), the token mean of its cross-entropy over the global
        batch, shared from the last pipeline stage; then the MoE auxiliary losses that entered the backward ("moe
        aux loss", "moe z loss"), averaged over the MoE layers."""
        losses = {}
        depths = self.config.mtp_num_layers
        if depths:
            device = next(model_chunks[0].parameters()).device
            totals = mappings.all_reduce(mtp_loss_totals(model_chunks, self.config, device),
                                         self.pstate.group("dp_cp"))
            mappings.broadcast(totals, self.pstate.pp_ranks[-1], self.pstate.group("pp"))
            losses.update({f"mtp {k} loss": totals[k - 1, 0] / totals[k - 1, 1] for k in range(1, depths + 1)})
        losses.update(moe_step_losses(model_chunks, self.pstate, self.config, self.sequence_parallel))
        return losses

    @staticmethod
    def step_metrics(losses: dict[str, float]) -> dict:
        """The logged figures of the step's losses: `mtp_<k>_loss` per depth and their mean, `mtp_loss` (the MoE
        losses are logged per interval, by interval_metrics)."""
        depths = [value for name, value in losses.items() if name.startswith("mtp ")]
        if not depths:
            return {}
        metrics = {f"mtp_{k}_loss": loss for k, loss in enumerate(depths, start=1)}
        metrics["mtp_loss"] = sum(depths) / len(depths)
        return metrics

    def after_step(self, model_chunks) -> None:
        """After the optimizer step: the expert biases move towards balance (--moe-router-enable-expert-bias)."""
        update_expert_biases(model_chunks, self.pstate, self.config)

    def interval_metrics(self, model_chunks) -> dict:
        """The MoE layers' losses and loads since the last call, summed over all ranks."""
        return moe_metrics(model_chunks, self.pstate, self.config, self.sequence_parallel)

    @staticmethod
    def statistics(model_chunks) -> list:
        """A copy of what the model has accumulated since the last step and interval, for `load_statistics` to put
        back when an iteration runs again."""
        return moe_statistics(model_chunks)

    @staticmethod
    def load_statistics(model_chunks, saved: list) -> None:
        load_moe_statistics(model_chunks, saved)
