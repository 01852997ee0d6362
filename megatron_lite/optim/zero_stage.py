"""The ZeRO stage: what a data-parallel rank keeps between steps, and what that makes it do.

The stages carry Megatron's --data-parallel-sharding-strategy names. Each behaviour that differs between
them is one property here, so the buffers, the DDP wrapper and the optimizer ask what to do instead of
comparing names:

  stage               optimizer state   persistent gradients          parameters between uses
  no_shard            whole             whole, all-reduced            whole
  optim       ZeRO-1  1/d shard         whole, reduce-scattered once  whole, all-gathered after the step
  optim_grads ZeRO-2  1/d shard         1/d shard, reduce-scattered   whole, all-gathered after the step
                                        every micro-batch
  optim_grads_params  1/d shard         1/d shard, as ZeRO-2          1/d shard, gathered per unit for
              ZeRO-3                                                  forward and backward
"""

from __future__ import annotations

import enum


class ZeroStage(enum.Enum):
    NO_SHARD = "no_shard"
    OPTIM = "optim"
    OPTIM_GRADS = "optim_grads"
    OPTIM_GRADS_PARAMS = "optim_grads_params"

    @property
    def shards_optimizer_state(self) -> bool:
        """Each rank steps only its 1/d of every bucket, so gradients are reduce-scattered, not all-reduced."""
        return self is not ZeroStage.NO_SHARD

    @property
    def shards_grads(self) -> bool:
        """Only this rank's gradient shard persists: a bucket's gradients are summed in a temporary buffer in
        each backward and reduce-scattered into the shard as soon as the bucket is complete."""
        return self in (ZeroStage.OPTIM_GRADS, ZeroStage.OPTIM_GRADS_PARAMS)

    @property
    def shards_params(self) -> bool:
        """Parameters live as shards and are gathered around each use."""
        return self is ZeroStage.OPTIM_GRADS_PARAMS

    @property
    def gathers_params_after_step(self) -> bool:
        """Every rank updated only its shard of whole parameters, which are then all-gathered."""
        return self.shards_optimizer_state and not self.shards_params
