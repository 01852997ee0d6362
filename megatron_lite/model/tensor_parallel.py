"""Tensor-parallel layers: Megatron's column/row-parallel linears, vocab-parallel embedding and loss.

A column-parallel linear splits the output features (Y_i = X A_i, no communication); a row-parallel
linear splits the input features and sums the partial products (Y = sum_i X_i A_i, one all-reduce).
A column layer followed by a row layer (attention QKV -> proj, MLP fc1 -> fc2) costs one all-reduce
forward and one backward. With sequence parallelism the residual stream between blocks is split along
the sequence: the column layer all-gathers its input and the row layer reduce-scatters its output
instead, the same bytes as the all-reduce but with activations and norms 1/tp the size.

Activations are [s, b, h] (sequence first, as in Megatron); with sequence parallelism [s/tp, b, h].

Given an `fp8` recipe (model/fp8.py), a column- or row-parallel linear runs its three GEMMs in FP8 with scales
maxed over the groups that split each GEMM dimension, so that they equal one process's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.model.fp8 import FP8Recipe, column_parallel_splits, fp8_linear, row_parallel_splits
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its output rows: [.., in] -> [.., out/tp] on each rank.

    `tp_chunks=2` is for fused weights such as SwiGLU's [gate; up]: each half is split separately, so
    every rank holds [gate_r; up_r] and can apply the gate locally. The output layer of a language model
    passes its vocabulary's `valid_rows`, and with tied embeddings either `skip_weight_param_allocation`
    (forward is given the embedding table) or, on a later pipeline stage, `tied_copy` (ShardSpec).
    """

    def __init__(self, in_features: int, out_features: int, pstate: ParallelState, *, bias: bool,
                 sequence_parallel: bool = False, gather_output: bool = False, init: str = "normal",
                 tp_chunks: int = 1, valid_rows: int | None = None, skip_weight_param_allocation: bool = False,
                 tied_copy: bool = False, fp8: FP8Recipe | None = None):
        super().__init__()
        self.tp_group = pstate.group("tp")
        self.sequence_parallel = sequence_parallel
        self.gather_output = gather_output
        self.fp8, self.fp8_splits = fp8, column_parallel_splits(pstate)
        spec = ShardSpec((out_features, in_features), tp_dim=0, tp_chunks=tp_chunks, init=init, valid_rows=valid_rows,
                         tied_copy=tied_copy)
        self.weight = None if skip_weight_param_allocation else new_parameter(spec, pstate.tp_size)
        self.bias = (new_parameter(ShardSpec((out_features,), tp_dim=0, tp_chunks=tp_chunks, init="zeros"),
                                   pstate.tp_size) if bias else None)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            x = mappings.gather_from_sequence_parallel_region(x, self.tp_group)  # [s/tp,b,h] -> [s,b,h]
        else:
            x = mappings.copy_to_tensor_parallel_region(x, self.tp_group)
        weight = self.weight if weight is None else weight
        if self.fp8 is None:
            y = F.linear(x, weight, self.bias)  # [s, b, out/tp]
        else:
            y = fp8_linear(x, weight, self.bias, self.fp8, self.fp8_splits)
        if self.gather_output:
            y = mappings.gather_from_tensor_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its input columns: [.., in/tp] -> [.., out], partial sums reduced.

    The bias is added once, after the reduction; under sequence parallelism each rank adds it to its
    sequence slice, so its gradient is a partial sum over TP (ShardSpec.sequence_parallel).
    """

    def __init__(self, in_features: int, out_features: int, pstate: ParallelState, *, bias: bool,
                 sequence_parallel: bool = False, init: str = "scaled_normal", fp8: FP8Recipe | None = None):
        super().__init__()
        self.tp_group = pstate.group("tp")
        self.sequence_parallel = sequence_parallel
        self.fp8, self.fp8_splits = fp8, row_parallel_splits(pstate)
        self.weight = new_parameter(ShardSpec((out_features, in_features), tp_dim=1, init=init), pstate.tp_size)
        self.bias = (new_parameter(ShardSpec((out_features,), init="zeros", sequence_parallel=sequence_parallel),
                                   pstate.tp_size) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is None:
            y = F.linear(x, self.weight)  # [s, b, out] partial sum over TP ranks
        else:
            y = fp8_linear(x, self.weight, None, self.fp8, self.fp8_splits)
        if self.sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)  # -> [s/tp, b, out]
        else:
            y = mappings.reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split by vocabulary rows: each rank looks up the ids it owns, zeros the rest,
    and the partial results are summed over TP (reduce-scattered along the sequence with SP).

    Rows at and beyond `vocab_size` pad the table to `padded_vocab_size`; they start at zero and are
    never looked up nor predicted.
    """

    def __init__(self, padded_vocab_size: int, vocab_size: int, hidden_size: int, pstate: ParallelState,
                 *, sequence_parallel: bool = False, tied_copy: bool = False):
        super().__init__()
        self.tp_group = pstate.group("tp")
        self.sequence_parallel = sequence_parallel
        rows = padded_vocab_size // pstate.tp_size
        self.vocab_start = pstate.tp_rank * rows
        self.vocab_end = self.vocab_start + rows
        self.weight = new_parameter(ShardSpec((padded_vocab_size, hidden_size), tp_dim=0, valid_rows=vocab_size,
                                              tied_copy=tied_copy), pstate.tp_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [s, b, h] (or [s/tp, b, h] with sequence parallelism)."""
        ids = input_ids.t()  # [s, b]: sequence first from here on
        if self.tp_group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)  # [s, b, h] partial over TP
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(local, self.tp_group)
        return mappings.reduce_from_tensor_parallel_region(local, self.tp_group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary, without gathering them: three all-reduces over TP
    (the max for stability, the target's logit, the sum of exponentials).

    The logits are the largest activation of a language model ([s, b, v/tp]), so the loss works in one
    fp32 buffer of their size, in place: the fp32 copy of the logits becomes the shifted logits, their
    exponentials, the softmax that backward needs, and finally the gradient. Every other intermediate is
    one value per token."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, label_smoothing):
        local_vocab = logits.shape[-1]
        padded_from = max(min(vocab_size - vocab_start, local_vocab), 0)
        probs = logits.float() if logits.dtype != torch.float32 else logits.clone()  # the one fp32 buffer
        if padded_from < local_vocab:  # padded vocabulary columns take no probability mass
            probs[..., padded_from:] = float("-inf")
        logits_max = mappings.all_reduce(probs.amax(dim=-1), group, op=torch.distributed.ReduceOp.MAX)
        probs.sub_(logits_max.unsqueeze(-1))  # shifted logits

        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = probs.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target_logit = mappings.all_reduce(target_logit, group)
        if label_smoothing > 0:
            sum_logits = mappings.all_reduce(probs[..., :padded_from].sum(dim=-1), group)

        sum_exp = mappings.all_reduce(probs.exp_().sum(dim=-1), group)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            # Smoothed target: (1 - eps) on the label, eps spread evenly over the real vocabulary.
            mean_log_prob = sum_logits / vocab_size - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob

        softmax = probs.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.padded_from = label_smoothing, vocab_size, padded_from
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        eps = ctx.label_smoothing
        # The gradient is built in the saved softmax, as Megatron does: the logits' size is the largest
        # activation of the model. A second backward through this graph fails autograd's version check.
        grad = softmax
        hit = (~outside).float() * (1.0 - eps)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.padded_from] -= eps / ctx.vocab_size
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pstate: ParallelState,
                                 vocab_size: int, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [..] from vocab-split logits [.., v/tp]; padded columns (>= vocab_size) ignored."""
    vocab_start = pstate.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, pstate.group("tp"), vocab_start, vocab_size,
                                            label_smoothing)
