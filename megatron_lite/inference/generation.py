"""Autoregressive generation with a KV cache: the prompt in one forward pass, then one token per step.

Each attention layer keeps the keys and values of every token it has seen (`InferenceParams`, Megatron's
name), so a step runs the model on the newest token only and attends over the cache
(model/attention/self_attention.py `cached_causal_attention`): O(s) work per token instead of O(s^2). A Gated
DeltaNet layer keeps instead its recurrent state and its convolution's last inputs (`LayerRecurrentState`):
O(1) per token. Tokens are chosen
greedily, or sampled with temperature, top-k and top-p (nucleus) filtering. Tensor parallelism works through
the normal model: every TP rank gathers the full logits and draws from an identically seeded generator, so
all ranks pick the same token. The whole model must sit in one pipeline stage.
"""

from __future__ import annotations

import torch

from megatron_lite.config.sections import ParallelConfig
from megatron_lite.hf.checkpoint import config_from_metadata, load_into_model, read_model_checkpoint
from megatron_lite.inference.sampling_params import SamplingParams
from megatron_lite.model.gpt import GPTModel, gather_vocab_logits
from megatron_lite.model.provider import build_model_chunk
from megatron_lite.parallel.state import ParallelState


class LayerKVCache:
    """One layer's keys and values [max_sequence_length, b, ng/tp, d] (d of keys and of values); rows [0, offset)
    hold earlier tokens."""

    def __init__(self, params: InferenceParams):
        self.params = params
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' key/value [s, b, ng/tp, d]; return those of all tokens so far [offset + s, ...]."""
        start = self.params.sequence_len_offset
        end = start + key.shape[0]
        if self.key is None:  # keys and values may differ in head size (multi-latent attention)
            rows = self.params.max_sequence_length
            self.key, self.value = key.new_empty((rows, *key.shape[1:])), value.new_empty((rows, *value.shape[1:]))
        if end > self.key.shape[0]:
            raise ValueError(f"the KV cache holds {self.key.shape[0]} tokens; {end} were asked for")
        self.key[start:end], self.value[start:end] = key, value
        return self.key[:end], self.value[:end]


class LayerRecurrentState:
    """One recurrent layer's state after the tokens so far: a Gated DeltaNet's (model/linear_attention/) delta-rule
    state [b, heads/tp, dk, dv] or a Mamba-2 mixer's (model/mamba/) scan state [b, heads/tp, p, n], and the
    convolution's last kernel - 1 inputs [kernel - 1, b, channels/tp]; None before the first token."""

    def __init__(self):
        self.state: torch.Tensor | None = None
        self.conv_inputs: torch.Tensor | None = None


class InferenceParams:
    """The generation state passed through GPTModel.forward: every layer's KV cache or recurrent state, and how
    many tokens (`sequence_len_offset`) they hold. The caller advances the offset after each forward pass."""

    def __init__(self, max_sequence_length: int):
        self.max_sequence_length = max_sequence_length
        self.sequence_len_offset = 0
        self.key_value_memory_dict: dict[int, LayerKVCache | LayerRecurrentState] = {}

    def layer_cache(self, layer_number: int, recurrent: bool = False) -> LayerKVCache | LayerRecurrentState:
        """The layer's KV cache, or with `recurrent` its recurrent state (a linear-attention layer)."""
        if layer_number not in self.key_value_memory_dict:
            self.key_value_memory_dict[layer_number] = LayerRecurrentState() if recurrent else LayerKVCache(self)
        return self.key_value_memory_dict[layer_number]


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """[b, vocab] logits -> [b] token ids."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        beyond = probs.cumsum(dim=-1) - probs >= params.top_p  # the tokens before already reach top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(beyond, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GPTModel, prompt_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams, *,
             eos_id: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """prompt_ids [b, s0] -> new ids [b, n], n <= max_new_tokens: generation stops once every sequence has
    produced `eos_id`, and a sequence that has is padded with it. Puts the model in eval mode."""
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model in one stage (pipeline-model-parallel-size 1)")
    batch, prompt_length = prompt_ids.shape
    config = model.config
    total = prompt_length + max_new_tokens
    if config.position_embedding_type == "learned_absolute" and total > config.max_position_embeddings:
        raise ValueError(f"prompt ({prompt_length}) + max-new-tokens ({max_new_tokens}) exceeds the model's "
                         f"max-position-embeddings ({config.max_position_embeddings})")
    model.eval()
    params = InferenceParams(total)
    tokens, generated = prompt_ids, []
    finished = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    for _ in range(max_new_tokens):
        start = params.sequence_len_offset
        positions = torch.arange(start, start + tokens.shape[1], device=prompt_ids.device)
        logits = model(tokens, positions, inference_params=params)[:, -1:]  # [b, 1, v/tp]
        params.sequence_len_offset += tokens.shape[1]
        next_ids = sample(gather_vocab_logits(logits, model.pstate, config.vocab_size)[:, 0], sampling, generator)
        if eos_id is not None:
            next_ids = next_ids.masked_fill(finished, eos_id)
            finished |= next_ids == eos_id
        generated.append(next_ids)
        if finished.all():
            break
        tokens = next_ids[:, None]
    return torch.stack(generated, dim=1)


def load_model(path: str, pstate: ParallelState | None = None, device: torch.device | None = None):
    """The model of checkpoint iteration directory `path` (built from the configuration it saved), in
    eval mode with this TP rank's shards; returns (model, the run's Config)."""
    pstate = pstate or ParallelState.single()
    saved, tensors = read_model_checkpoint(path)
    config = config_from_metadata(saved)
    config.parallel = ParallelConfig(tensor_model_parallel_size=pstate.tp_size,
                                     expert_tensor_parallel_size=pstate.etp_size)
    model = build_model_chunk(config, pstate, device=device)
    load_into_model(model, tensors, pstate.tensor_split)
    return model.eval(), config
