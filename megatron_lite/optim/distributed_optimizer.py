"""The distributed optimizer (ZeRO-1/2/3): each data-parallel rank steps only its shard of the parameters.

With Adam in mixed precision a parameter costs 18 bytes: bf16 weight 2, fp32 gradient 4, fp32 master 4,
two fp32 moments 8. Data-parallel ranks hold identical copies of all of it. As in Megatron's
DistributedOptimizer, the gradient buckets (optim/data_parallel.py) are reduce-scattered instead of
all-reduced, so rank r of d holds the reduced gradients of the r-th 1/d of every bucket; it keeps fp32
masters and Adam moments for exactly those elements, steps them, casts them into the bucket's parameter
buffer and all-gathers the buckets (ZeRO-3 gathers per layer on use instead). Per parameter, with d the
size of the dp x cp group (expert parameters: the expert-data-parallel group):

  strategy             weights   grads   master+moments   bf16 total     fp32 total (no master)
  no_shard             2         4       12               18             16
  optim (ZeRO-1)       2         4       12/d             6 + 12/d       8 + 8/d
  optim_grads (ZeRO-2) 2         4/d     12/d             2 + 16/d       4 + 12/d
  optim_grads_params   2/d       4/d     12/d             18/d           16/d

plus bucket padding (under d elements per bucket). The gradient norm sums squares over the owned
shards, which partition every data-parallel group, so each element counts once (tensor-parallel
replicas are counted on TP rank 0, as without sharding). With N distributed-optimizer instances
(--num-distributed-optimizer-instances) d is the size of one instance, dp x cp / N (expert: edp / N): the
shards partition each instance, every element is stepped on N ranks, and its square is divided by N.

Checkpoint protocol (the same for `Optimizer` and `DistributedOptimizer`). `sharded_state_dict()` returns

  optimizer.state.exp_avg.<global name>     FlatShard: Adam's first moment
  optimizer.state.exp_avg_sq.<global name>  FlatShard: Adam's second moment
  optimizer.state.momentum_buffer.<name>    FlatShard: Muon's momentum, instead of Adam's moments, for the
                                            hidden matrices of --optimizer muon (optim/muon_optimizer.py)
  optimizer.state.fp32_param.<global name>  FlatShard: the fp32 master of a bf16/fp16 weight (an fp32
                                            weight is its own master and is saved with the model)
  optimizer.step                            int: optimizer steps applied (the same for every parameter)
  optimizer.grad_scaler                     dict or None: the fp16 loss scaler's state

Global names are GPTModel.global_name's (DistributedDataParallel.module.named_global_parameters()). A
FlatShard (model/sharding.py) is elements [start, stop) of this rank's tensor-parallel shard of the
parameter, flattened row-major, as a live 1-D tensor; `spec` (ShardSpec) with the rank's TP rank places
that shard in the global tensor. The plain optimizer holds whole shards, (0, numel); the distributed
optimizer a flat range, which is a few row-major boxes of the global tensor. Several ranks may hold the
same elements (data-parallel replicas of the plain optimizer, tensor-parallel replicas, the last stage's
copy of tied embeddings) with equal values: write them once. To load, fill the FlatShards of a fresh
`sharded_state_dict()` in place (or pass equal ones) and call `load_sharded_state_dict(state)`, which also
updates the model's weights from the masters. Model weights follow the same protocol through
`DistributedDataParallel.sharded_parameters()` (under ZeRO-3 they exist only as shards).
"""

from __future__ import annotations

import torch

from megatron_lite.optim.data_parallel import DistributedDataParallel
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.optim.param_and_grad_buffer import OwnedRange
from megatron_lite.parallel.state import ParallelState


class DistributedOptimizer(Optimizer):
    """AdamW on this rank's owned ranges of the model chunks' buckets (ZeRO-1/2/3)."""

    def __init__(self, model_chunks: list[DistributedDataParallel], config, pstate: ParallelState):
        self.model_chunks = model_chunks
        named = [(name, p) for chunk in model_chunks for name, p in chunk.module.named_global_parameters()
                 if p.requires_grad]
        super().__init__(named, config, pstate)

    def _owned_ranges(self, params: list[torch.nn.Parameter]) -> list[OwnedRange]:
        return [r for chunk in self.model_chunks for r in chunk.owned_ranges()]

    def _replication(self) -> tuple[int, int]:
        instances = self.pstate.dist_opt_instances  # owned ranges partition each instance
        return instances, instances

    def _sync_params(self) -> None:
        for chunk in self.model_chunks:
            chunk.start_param_sync()
