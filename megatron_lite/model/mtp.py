"""Multi-token prediction (DeepSeek-V3, section 2.2; Megatron's --mtp-num-layers): D extra prediction depths.

Module k (1..D) runs after the last transformer layer on the last pipeline stage. At position i it takes the
previous depth's hidden state h^{k-1}_i (h^0: the decoder's output after its final norm) and the embedding of
token i + k, normalises each with an RMSNorm (LayerNorm under --normalization LayerNorm) of its own, projects
their concatenation [enorm(emb); hnorm(h)] from 2h to h (`eh_proj`, Megatron's and vLLM's order; the paper
writes the two halves the other way round, the same model with M_k's columns swapped), runs its transformer
layer (or the layers a --hybrid-layer-pattern writes after each /, such as Megatron's "/MM") and a final norm,
and predicts token i + k + 1 with the shared output layer. Embedding and output layer are the main model's: under
pipeline parallelism the last stage holds a copy of the word (and position) embedding table, kept equal to the
first stage's as tied embeddings are (GPTModel.shared_embedding_parameters).

Loss. Depth k's targets are the labels shifted k further left, its loss mask the mask shifted with them; the
last k positions of the sequence have no target and are masked (Megatron's roll_tensor with zero fill; the
shift ignores document boundaries, as Megatron's unpacked path does; under context parallelism the ranks'
chunks are gathered into whole sequences, shifted and cut again). With S_k its masked cross-entropy sum and N_k
its unmasked positions (of the micro-batch's whole sequences, summed over context-parallel ranks),
L_MTP = factor / D * sum_k S_k / N_k (--mtp-loss-scaling-factor). It enters the backward pass as Megatron's
MTPLossAutoScaler does, beside the language-model loss: per micro-batch (the default) with the weight 1 / m of a
micro-batch mean, under --calculate-per-token-loss with the weight N_0 (the micro-batch's unmasked tokens), so
that the division by the global token count leaves factor / D * sum_k S_k N_0 / (N_k N). (Megatron divides by
each context-parallel rank's own counts, which differs where a loss mask leaves the ranks' shares unequal; see
model/loss_scaling.py for the same choice in the language-model loss.) The reported language-model loss does
not include it.

What is logged: per depth, S_k and N_k summed over the micro-batches and data-parallel ranks of the step
(`mtp_loss_totals`), so `mtp_<k>_loss` is the token mean of depth k's cross-entropy and `mtp_loss` the mean
over the D depths, both before the scaling factor (Megatron logs `mtp_<k> loss` the same way, as a mean of
micro-batch means, which is the same figure when no loss mask leaves micro-batches unequal).

The modules run only when the model trains: evaluation reports the language-model loss alone, and
generation (no labels) never reaches them. Each module's layers are numbered after the decoder's, depth by depth,
and are of the last decoder layer's kind unless the pattern says otherwise (config/layer_specs.py
depth_layer_specs; as Megatron builds it from the last layer's spec: an MoE layer in DeepSeek-V3, whose router
statistics and expert bias are kept under that number); they are not recomputed under --recompute-granularity
full. A depth of one layer holds it as `transformer_layer`, one of several as `transformer_layers`.
"""

from __future__ import annotations

import torch

from megatron_lite.config.layer_specs import depth_layer_specs
from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.attention.context_parallel import load_balanced_indices
from megatron_lite.model.loss_scaling import auxiliary_loss_weight
from megatron_lite.model.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
from megatron_lite.model.transformer import Norm, TransformerLayer
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


def shift_left(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """[.., s] -> [.., s]: element i is element i + k of `tensor`, the last k elements zero."""
    shifted = torch.zeros_like(tensor)
    if k < tensor.shape[-1]:
        shifted[..., :tensor.shape[-1] - k] = tensor[..., k:]
    return shifted


class _AttachLoss(torch.autograd.Function):
    """Identity on `output`; its backward also feeds d(total)/d(loss) = 1 into `loss`'s graph, so a loss that
    is no output of the chunk is backpropagated with the chunk's output (Megatron's MTPLossAutoScaler)."""

    @staticmethod
    def forward(ctx, output, loss):
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(loss)


class MultiTokenPredictionLayer(torch.nn.Module):
    """Prediction depth `depth` (1-based): (h^{k-1} [s(/tp), b, h], embedding of the shifted tokens) -> h^k."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, depth: int, *, sequence_parallel: bool,
                 attention_backend: str, rng_tracker, cp_comm_type: str):
        super().__init__()
        self.tp_group = pstate.group("tp")
        self.sequence_parallel = sequence_parallel
        h = config.hidden_size
        self.enorm = Norm(config, sequence_parallel)
        self.hnorm = Norm(config, sequence_parallel)
        self.eh_proj = ColumnParallelLinear(2 * h, h, pstate, bias=False, sequence_parallel=sequence_parallel)
        # numbered after the decoder's layers, so their FP8 choice treats them as the last layers and their kinds
        # are the depth's specs (an MoE layer's statistics are kept under its number)
        per_depth = len(depth_layer_specs(config))
        layers = [TransformerLayer(config, pstate, config.num_layers + (depth - 1) * per_depth + i,
                                   sequence_parallel=sequence_parallel, attention_backend=attention_backend,
                                   rng_tracker=rng_tracker, cp_comm_type=cp_comm_type) for i in range(per_depth)]
        if per_depth == 1:
            self.transformer_layer = layers[0]
        else:
            self.transformer_layers = torch.nn.ModuleList(layers)
        self.depth_layers = tuple(layers)  # in order, whichever name holds them
        self.final_layernorm = Norm(config, sequence_parallel)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rotary) -> torch.Tensor:
        x = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)  # [s(/tp), b, 2h]
        x = self.eh_proj(x)  # [s, b, h/tp]
        x = mappings.gather_from_tensor_parallel_region(x, self.tp_group)  # [s, b, h]
        if self.sequence_parallel:
            x = mappings.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        for layer in self.depth_layers:
            x = layer(x, rotary)
        return self.final_layernorm(x)


class MultiTokenPrediction(torch.nn.Module):
    """The D prediction depths of the last pipeline stage, and their loss."""

    def __init__(self, config: ModelConfig, pstate: ParallelState, *, sequence_parallel: bool, attention_backend: str,
                 rng_tracker, cp_comm_type: str):
        super().__init__()
        self.pstate = pstate
        self.cp_group = pstate.group("cp")
        self.vocab_size = config.vocab_size
        self.scaling_factor = config.mtp_loss_scaling_factor
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(config, pstate, depth, sequence_parallel=sequence_parallel,
                                      attention_backend=attention_backend, rng_tracker=rng_tracker,
                                      cp_comm_type=cp_comm_type)
            for depth in range(1, config.mtp_num_layers + 1))
        # Since the last mtp_loss_totals, float64 on the model's device: per depth, S_k and N_k (None until used).
        self.totals: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, rotary,
                labels: torch.Tensor, loss_mask: torch.Tensor, embedding, output_layer) -> torch.Tensor:
        """hidden [s(/tp), b, h]: the decoder's output; input_ids, labels, loss_mask [b, s]; position_ids [s] or
        [b, s]; `embedding(ids, positions)` and `output_layer(hidden)` are the model's. Returns `hidden`, with the
        scaled MTP loss attached to its backward."""
        loss_mask = loss_mask.float()
        whole = [self._whole_sequence(t) for t in (input_ids, position_ids, labels, loss_mask)]
        depth_losses, totals = [], []
        hidden_k = hidden
        for k, layer in enumerate(self.layers, start=1):
            ids, positions, targets, mask = (self._this_rank(shift_left(t, k)) for t in whole)
            hidden_k = layer(hidden_k, embedding(ids, positions), rotary)
            logits = output_layer(hidden_k)  # [s, b, v/tp]
            per_token = vocab_parallel_cross_entropy(logits, targets.t(), self.pstate, self.vocab_size).t()  # [b, s]
            loss_sum, tokens = (per_token.float() * mask).sum(), mask.sum()
            # the micro-batch's N_k: its whole sequences', summed over the context-parallel ranks
            depth_losses.append(loss_sum / mappings.all_reduce(tokens.detach().clone(), self.cp_group).clamp(min=1.0))
            totals.append(torch.stack([loss_sum.detach(), tokens]).double())
        totals = torch.stack(totals)  # [D, 2], this rank's
        self.totals = totals if self.totals is None else self.totals + totals
        loss = self.scaling_factor / len(self.layers) * torch.stack(depth_losses).sum()
        microbatch_tokens = mappings.all_reduce(loss_mask.sum(), self.cp_group)  # N_0
        return _AttachLoss.apply(hidden, loss * auxiliary_loss_weight(microbatch_tokens))

    def _whole_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., s/cp] -> [..., s]: with context parallelism a rank holds two chunks of each sequence
        (context_parallel.load_balanced_indices); the shift by k needs the tokens of the others."""
        cp = self.pstate.cp_size
        if cp == 1:
            return tensor
        gathered = mappings.all_gather_along_dim(tensor.contiguous(), self.cp_group, -1)  # ranks' shares in order
        length = gathered.shape[-1]
        order = torch.cat([load_balanced_indices(length, cp, rank) for rank in range(cp)]).to(tensor.device)
        return torch.empty_like(gathered).index_copy_(-1, order, gathered)

    def _this_rank(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., s] -> this context-parallel rank's [..., s/cp] (the identity without context parallelism)."""
        cp = self.pstate.cp_size
        if cp == 1:
            return tensor
        mine = load_balanced_indices(tensor.shape[-1], cp, self.pstate.cp_rank)
        return tensor.index_select(-1, mine.to(tensor.device))


@torch.no_grad()
def mtp_loss_totals(model_chunks, config: ModelConfig, device) -> torch.Tensor:
    """This rank's [D, 2] (S_k, N_k) per depth since the last call, zeros on ranks without MTP modules; resets
    them. Sum it over data-parallel ranks and share it from the last pipeline stage to report it."""
    totals = torch.zeros(config.mtp_num_layers, 2, dtype=torch.float64, device=device)
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, MultiTokenPrediction) and module.totals is not None:
                totals += module.totals
                module.totals = None
    return totals
