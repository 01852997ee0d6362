"""The run's optimizer from its flags: Adam or Muon, whole (no_shard) or sharded over data-parallel ranks."""

from __future__ import annotations

from megatron_lite.config.sections import Config
from megatron_lite.optim.data_parallel import DistributedDataParallel
from megatron_lite.optim.distributed_optimizer import DistributedOptimizer
from megatron_lite.optim.muon_optimizer import build_muon_optimizer
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.optim.zero_stage import ZeroStage
from megatron_lite.parallel.state import ParallelState


def build_optimizer(config: Config, model_chunks: list[DistributedDataParallel], pstate: ParallelState) -> Optimizer:
    """The optimizer (--optimizer) for the run's data-parallel sharding strategy."""
    sharded = ZeroStage(config.parallel.data_parallel_sharding_strategy).shards_optimizer_state
    if config.optimizer.optimizer == "muon":
        return build_muon_optimizer(config, model_chunks, pstate, sharded)
    if not sharded:
        named = [(name, p) for chunk in model_chunks for name, p in chunk.module.named_global_parameters()
                 if p.requires_grad]
        return Optimizer(named, config.optimizer, pstate)
    return DistributedOptimizer(model_chunks, config.optimizer, pstate)
