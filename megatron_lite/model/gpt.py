"""GPTModel: embedding -> transformer layers [start, end) -> final norm -> output layer and loss.

One class covers GPT-2 (LayerNorm, GELU, learned positions, biases, tied embeddings) and Llama
(RMSNorm, SwiGLU, RoPE, GQA, untied, no biases) by configuration. A model chunk may hold any
contiguous range of layers, with the embedding only on the first pipeline stage (`pre_process`) and
the output layer only on the last (`post_process`); the pipeline schedule feeds the others through
`set_input_tensor`. With --mtp-num-layers the last stage also holds the multi-token prediction modules
(model/mtp.py) and, under pipeline parallelism, a copy of the first stage's embedding for them.
Parameters have global names (`decoder.layers.<global index>...`) that decide
their initial values and their checkpoint keys, so neither depends on the layout. GPTModel is a model
chunk as model/contract.py defines one.
"""

from __future__ import annotations

import re

import torch

from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.self_attention import (
    Documents,
    Positions,
    choose_attention_backend,
    rotary_embedding,
)
from megatron_lite.model.mtp import MultiTokenPrediction
from megatron_lite.model.sharding import ShardSpec, initialize_parameters, new_parameter
from megatron_lite.model.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron_lite.model.training_hooks import GPTTrainingHooks
from megatron_lite.model.transformer import HiddenDropout, TransformerBlock, TransformerLayer
from megatron_lite.parallel import mappings
from megatron_lite.parallel.random import RNGTracker
from megatron_lite.parallel.state import ParallelState

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class Embedding(torch.nn.Module):
    """Word embeddings (vocab-parallel) plus learned absolute positions when configured, then dropout."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, padded_vocab: int, *,
                 sequence_parallel: bool, rng_tracker: RNGTracker | None, tied_copy: bool = False):
        """`tied_copy`: the last pipeline stage's copy of the first stage's tables (ShardSpec.tied_copy)."""
        super().__init__()
        self.pstate = pstate
        self.sequence_parallel = sequence_parallel
        self.word_embeddings = VocabParallelEmbedding(padded_vocab, config.vocab_size, config.hidden_size,
                                                      pstate, sequence_parallel=sequence_parallel, tied_copy=tied_copy)
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            spec = ShardSpec((config.max_position_embeddings, config.hidden_size),
                             sequence_parallel=sequence_parallel, tied_copy=tied_copy)
            self.position_embeddings = new_parameter(spec, 1)
        self.dropout = HiddenDropout(config.hidden_dropout, rng_tracker, sequence_parallel)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s]; position_ids [s], or [b, s] per sample (--reset-position-ids)."""
        x = self.word_embeddings(input_ids)  # [s, b, h], or [s/tp, b, h] with sequence parallelism
        if self.position_embeddings is not None:
            if self.sequence_parallel:
                position_ids = position_ids.chunk(self.pstate.tp_size, dim=-1)[self.pstate.tp_rank]
            positions = self.position_embeddings[position_ids]  # [s, h] or [b, s, h]
            x = x + (positions.unsqueeze(1) if position_ids.dim() == 1 else positions.transpose(0, 1))
        return self.dropout(x)


class GPTModel(torch.nn.Module):
    """A decoder-only language model chunk holding global layers [layer_offset, layer_offset + num_layers)."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, padded_vocab: int, seed: int,
                 pre_process: bool = True, post_process: bool = True, layer_offset: int = 0,
                 num_layers: int | None = None, sequence_parallel: bool = False,
                 device: torch.device | None = None, cp_comm_type: str = "p2p"):
        super().__init__()
        device = torch.device(device or "cpu")
        self.config = config
        self.pstate = pstate
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_offset = layer_offset
        self.sequence_parallel = sequence_parallel
        self.share_embeddings = not config.untie_embeddings_and_output_weights
        self.has_mtp = post_process and bool(config.mtp_num_layers)
        has_embedding = pre_process or self.has_mtp
        self.input_tensor = None
        num_layers = config.num_layers if num_layers is None else num_layers
        self.rng_tracker = tracker = RNGTracker(seed, pstate.tp_rank, pstate.pp_rank, device, layer_offset)
        backend = choose_attention_backend(config.attention_backend, device)
        with device:  # parameters and buffers are made where they live, not on the host and then copied
            if has_embedding:
                self.embedding = Embedding(config, pstate, padded_vocab, sequence_parallel=sequence_parallel,
                                           rng_tracker=tracker, tied_copy=not pre_process)
            self.rotary = rotary_embedding(config) if config.rotary_position_embeddings else None
            layers = [TransformerLayer(config, pstate, number, sequence_parallel=sequence_parallel,
                                       attention_backend=backend, rng_tracker=tracker, cp_comm_type=cp_comm_type)
                      for number in range(layer_offset, layer_offset + num_layers)]
            self.decoder = TransformerBlock(layers, config, final_norm=post_process,
                                            sequence_parallel=sequence_parallel, rng_tracker=tracker)
            if post_process:  # with tied embeddings: reads the input table, or holds a copy of the first stage's
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, padded_vocab, pstate, bias=False, sequence_parallel=sequence_parallel,
                    valid_rows=config.vocab_size, skip_weight_param_allocation=self.share_embeddings and has_embedding,
                    tied_copy=self.share_embeddings and not has_embedding)
            self.mtp = (MultiTokenPrediction(config, pstate, sequence_parallel=sequence_parallel,
                                             attention_backend=backend, rng_tracker=tracker, cp_comm_type=cp_comm_type)
                        if self.has_mtp else None)
        initialize_parameters(self.named_global_parameters(), seed, config.init_method_std, config.num_layers,
                              pstate.tensor_split)

    # ----------------------------------------------------------------------------------------------
    def global_name(self, local_name: str) -> str:
        """The layout-independent name of a parameter: global layer index, global expert index (local expert
        j of expert-parallel rank r is expert r E/ep + j); a last stage's copy of tied embeddings is the
        word-embedding table itself."""
        if self.share_embeddings and local_name == "output_layer.weight":
            return WORD_EMBEDDINGS
        name = re.sub(r"^decoder\.layers\.(\d+)\.",
                      lambda m: f"decoder.layers.{int(m.group(1)) + self.layer_offset}.", local_name)
        first_expert = self.pstate.ep_rank * (self.config.num_experts or 0) // self.pstate.ep_size
        return re.sub(r"\.mlp\.experts\.(\d+)\.", lambda m: f".mlp.experts.{int(m.group(1)) + first_expert}.", name)

    def named_global_parameters(self):
        for name, param in self.named_parameters():
            yield self.global_name(name), param

    def named_global_buffers(self):
        """State other than parameters that checkpoints carry: buffers with a ShardSpec (the MoE routers'
        expert biases), by global name."""
        for name, buffer in self.named_buffers():
            if hasattr(buffer, "spec"):
                yield self.global_name(name), buffer

    def shared_embedding_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters kept equal between the first and last pipeline stage, in the same order on both: the word
        embeddings when the output layer is tied to them or multi-token prediction reads them, and the learned
        positions too for multi-token prediction."""
        if self.pre_process == self.post_process:
            return []
        if self.pre_process and not self.config.mtp_num_layers or self.post_process and not self.has_mtp:
            tied = self.embedding.word_embeddings.weight if self.pre_process else self.output_layer.weight
            return [tied] if self.share_embeddings else []
        positions = self.embedding.position_embeddings
        return [self.embedding.word_embeddings.weight] + ([positions] if positions is not None else [])

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Activations from the previous pipeline stage, used instead of the embedding."""
        self.input_tensor = tensor

    def sharding_units(self) -> list[TransformerLayer]:
        return list(self.decoder.layers)

    def rng_trackers(self) -> list[RNGTracker]:
        return [self.rng_tracker]

    def training_hooks(self) -> GPTTrainingHooks:
        return GPTTrainingHooks(self.config, self.pstate, self.sequence_parallel)

    # ----------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor,
                labels: torch.Tensor | None = None, inference_params=None,
                document_ids: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, labels [b, s]; position_ids [s] or [b, s]: the positions of this rank's tokens (with context
        parallelism s is the local s/cp, two load-balanced chunks; see get_batch_on_this_cp_rank).
        document_ids [b, s] (--reset-attention-mask; on the host, over the whole sequence even with context
        parallelism): each token's document, within which alone it attends (attention.Documents).

        loss_mask [b, s] (default: every token) weighs the multi-token prediction loss, which a training forward
        with labels attaches to the backward of the returned loss (model/mtp.py).

        Returns the per-token loss [b, s] on the last stage when labels are given, this rank's vocab
        slice of the logits [b, s, v/tp] when not, and the hidden states [s(/tp), b, h] elsewhere.
        `inference_params` (generation.InferenceParams) is the KV cache of the tokens before input_ids.
        """
        x = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor
        positions = self.rotary(position_ids) if self.rotary is not None else Positions()
        if document_ids is not None:
            positions = positions._replace(documents=Documents(document_ids, position_ids.device))
        x = self.decoder(x, positions, inference_params)
        if not self.post_process:
            return x
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        if self.mtp is not None and labels is not None and self.training:
            x = self.mtp(x, input_ids, position_ids, positions, labels,
                         torch.ones_like(labels) if loss_mask is None else loss_mask, self.embedding,
                         lambda hidden: self.output_layer(hidden, weight))
        logits = self.output_layer(x, weight)  # [s, b, v/tp]
        if labels is None:
            return logits.transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.pstate, self.config.vocab_size)
        return loss.t()  # [b, s]


def gather_vocab_logits(logits: torch.Tensor, pstate: ParallelState, vocab_size: int) -> torch.Tensor:
    """[b, s, v/tp] slices -> [b, s, vocab_size]: the full logits without vocabulary padding."""
    full = mappings.all_gather_along_dim(logits.contiguous(), pstate.group("tp"), -1)
    return full[..., :vocab_size]
