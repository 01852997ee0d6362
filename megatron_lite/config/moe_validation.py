"""Configuration checks of the experts' layout (model/moe/layer.py, parallel/state.py), run by validation.validate
before any process group exists: one line per problem, saying what to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_lite.config.sections import Config


def expert_layout_problems(config: Config) -> list[str]:
    """What --expert-model-parallel-size and --expert-tensor-parallel-size cannot be, or not with the rest of the
    layout: the experts regroup a stage's tp x cp x dp ranks as etp x ep x edp."""
    m, p = config.model, config.parallel
    tp, cp, dp, ep = (p.tensor_model_parallel_size, p.context_parallel_size, p.data_parallel_size,
                      p.expert_model_parallel_size)
    etp = p.expert_tensor_parallel_size or tp
    problems = []
    if not m.num_experts:
        return problems
    stage = tp * cp * dp
    if stage % (etp * ep):
        problems.append(f"expert-tensor-parallel-size x expert-model-parallel-size ({etp} x {ep} = {etp * ep}) "
                        f"must divide tensor x context x data-parallel size ({tp} x {cp} x {dp} = {stage})")
    if m.num_experts % ep:
        problems.append(f"num-experts ({m.num_experts}) must be divisible by expert-model-parallel-size ({ep})")
    if m.moe_ffn_hidden_size % etp:
        problems.append(f"moe-ffn-hidden-size ({m.moe_ffn_hidden_size}) must be divisible by "
                        f"expert-tensor-parallel-size ({etp})")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        problems.append(f"moe-shared-expert-intermediate-size ({shared}) must be divisible by "
                        f"tensor-model-parallel-size ({tp})")
    if etp != tp and tp > 1 and not p.sequence_parallel:
        problems.append(f"expert-tensor-parallel-size ({etp}) different from tensor-model-parallel-size ({tp}) "
                        f"needs --sequence-parallel (the tensor-parallel ranks must hold different tokens)")
    instances = p.num_distributed_optimizer_instances
    if etp != tp and instances > 1:
        problems.append(f"--num-distributed-optimizer-instances {instances} needs expert-tensor-parallel-size "
                        f"({etp}) equal to tensor-model-parallel-size ({tp})")
    elif stage % (etp * ep) == 0 and (stage // (etp * ep)) % instances:
        problems.append(f"num-distributed-optimizer-instances ({instances}) must divide the expert data-parallel "
                        f"size (tensor x context x data-parallel / (expert-tensor x expert-model-parallel) = "
                        f"{stage // (etp * ep)})")
    return problems
