"""A checkpoint's model at a TP x PP x DP layout, answering what evaluation asks: log-probabilities and greedy ids.

Under torchrun the model is built and loaded as `pretrain_gpt.py --load` builds it (the checkpoint reshards to
the layout), and every rank of a data-parallel replica takes part in each forward: tensor-parallel ranks
split the heads, pipeline stages pass activations through the pipeline schedule (forward only). A batch is
padded to `micro_batch_size` rows of `max_length` tokens, the shape every stage's messages have; the last
stage turns its logits (gathered over TP) into log-probabilities of the asked-for tokens and broadcasts them
over the pipeline, so every rank of the replica returns the same answer. Data-parallel replicas answer
different requests (the harness splits them by `dp_rank`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_lite.checkpoint.checkpointing import Checkpointer
from megatron_lite.checkpoint.directory import read_metadata
from megatron_lite.config.arguments import make_config
from megatron_lite.errors import ConfigError
from megatron_lite.hf.checkpoint import config_from_metadata, model_flags
from megatron_lite.inference.generation import generate
from megatron_lite.inference.sampling_params import SamplingParams
from megatron_lite.model.gpt import gather_vocab_logits
from megatron_lite.model.provider import build_model_chunk
from megatron_lite.training.loop import build_model, get_schedule, initialize


class ModelRunner:
    """`model` (this rank's chunks, built for `config`'s layout) scoring batches of up to `micro_batch_size`
    token lists of up to `max_length` tokens: a checkpoint's (`from_checkpoint`) or a training run's own."""

    def __init__(self, config, pstate, device, model: list, max_length: int, micro_batch_size: int, vocab_size: int):
        self.config, self.pstate, self.device, self.model = config, pstate, device, model
        self.max_length, self.micro_batch_size, self.vocab_size = max_length, micro_batch_size, vocab_size

    @classmethod
    def from_checkpoint(cls, root: str, path: str, iteration: int, tp: int, pp: int, micro_batch_size: int,
                        device: str) -> ModelRunner:
        """The model of checkpoint iteration `path` (of --save directory `root`) at TP x PP, DP the rest of the
        world, in eval mode; max_length is its --max-position-embeddings."""
        saved = config_from_metadata(read_metadata(path))
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; the process group is joined in initialize
        if tp < 1 or pp < 1 or world % (tp * pp):
            raise ConfigError(f"--model_args tensor_model_parallel_size x pipeline_model_parallel_size ({tp} x {pp}) "
                              f"must divide the {world} process(es); launch a multiple of {max(tp, 1) * max(pp, 1)} "
                              f"with torchrun")
        max_length = saved.model.max_position_embeddings
        values = {**model_flags(saved.model), "seq_length": max_length, "mock_data": True,
                  "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                  "micro_batch_size": micro_batch_size, "global_batch_size": micro_batch_size * world // (tp * pp),
                  "train_iters": 1, "load": root, "ckpt_step": iteration, "finetune": True, "device": device}
        config = make_config(values, world)
        pstate, device = initialize(config)
        model = build_model(config, pstate, build_model_chunk, device)
        Checkpointer(config, pstate, device).load_checkpoint(model, None)
        for chunk in model:
            chunk.eval()
        return cls(config, pstate, device, model, max_length, micro_batch_size, saved.model.vocab_size)

    @torch.no_grad()
    def _last_stage_logits(self, inputs: list[list[int]]) -> torch.Tensor | None:
        """Logits [rows, max_length, vocab] of the padded batch on the last stage (None on the others)."""
        batch = torch.zeros(self.micro_batch_size, self.max_length, dtype=torch.long, device=self.device)
        for row, ids in enumerate(inputs):
            batch[row, :len(ids)] = torch.tensor(ids, device=self.device)
        positions = torch.arange(self.max_length, device=self.device)
        pstate, vocab = self.pstate, self.vocab_size

        def forward_step(data_iterator, chunk):
            def loss_func(logits):
                return torch.zeros(()), torch.ones(()), {"logits": gather_vocab_logits(logits, pstate, vocab)}
            return chunk(batch, positions), loss_func

        reports, _ = get_schedule(self.config)(forward_step, None, self.model, 1, pstate=pstate, config=self.config,
                                               forward_only=True)
        return reports[0]["logits"] if reports else None

    def _from_last_stage(self, value):
        """`value` of the last pipeline stage, on every stage."""
        if self.pstate.pp_size == 1:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=self.pstate.pp_ranks[-1], group=self.pstate.group("pp"))
        return holder[0]

    def score(self, inputs: list[list[int]], targets: list[list[int]]) -> list[tuple[float, bool]]:
        """For each input and the target tokens its last len(target) positions predict: the summed
        log-probability of the targets and whether each is the most likely token."""
        logits = self._last_stage_logits(inputs)
        results = None
        if logits is not None:
            results = []
            for row, (ids, target) in enumerate(zip(inputs, targets)):
                log_probs = torch.log_softmax(logits[row, len(ids) - len(target):len(ids)].float(), dim=-1)
                wanted = torch.tensor(target, device=log_probs.device)
                results.append((float(log_probs.gather(1, wanted[:, None]).sum()),
                                bool((log_probs.argmax(dim=-1) == wanted).all())))
        return self._from_last_stage(results)

    def greedy(self, prompt: list[int], max_new_tokens: int, eos_id: int) -> list[int]:
        """Greedy continuation of `prompt` up to `max_new_tokens` or `eos_id` (included): with the KV cache
        in one stage, recomputing the sequence through the pipeline for each token across stages."""
        if self.pstate.pp_size == 1:
            prompt_ids = torch.tensor([prompt], device=self.device)
            ids = generate(self.model[0].module, prompt_ids, max_new_tokens, SamplingParams(), eos_id=eos_id)[0]
            ids = ids.tolist()
            return ids[:ids.index(eos_id) + 1] if eos_id in ids else ids
        ids = list(prompt)
        generated = []
        for _ in range(max_new_tokens):
            logits = self._last_stage_logits([ids])
            token = None if logits is None else int(logits[0, len(ids) - 1].argmax())
            token = self._from_last_stage(token)
            generated.append(token)
            ids.append(token)
            if token == eos_id or len(ids) >= self.max_length:
                break
        return generated
