"""The one place a model chunk is built from a run's configuration: training (pretrain_gpt.py), evaluation,
generation and the Megatron-LM converter all call `build_model_chunk`, so a new kind of layer or a new argument
of the model is wired here once."""

from __future__ import annotations

import torch

from megatron_lite.config.layer_split import ChunkPlan
from megatron_lite.config.sections import Config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState


def build_model_chunk(config: Config, pstate: ParallelState, plan: ChunkPlan | None = None,
                      device: torch.device | None = None) -> GPTModel:
    """The chunk of `config`'s network that `plan` names (default: the whole network, embedding to output layer)
    with this rank's shards of `pstate`'s layout, its parameters made on `device`. The vocabulary is padded to a
    multiple of --make-vocab-size-divisible-by x TP, as Megatron pads it."""
    m, p = config.model, config.parallel
    plan = plan or ChunkPlan(layer_offset=0, num_layers=m.num_layers, pre_process=True, post_process=True)
    return GPTModel(m, pstate, padded_vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by,
                                                              pstate.tp_size),
                    seed=config.training.seed, pre_process=plan.pre_process, post_process=plan.post_process,
                    layer_offset=plan.layer_offset, num_layers=plan.num_layers,
                    sequence_parallel=p.sequence_parallel, device=device, cp_comm_type=p.cp_comm_type)
