"""Each tensor-parallel layer equals its single-device PyTorch counterpart at TP 1, 2 and 4.

One call on a 4-rank world runs every case at every TP size (TP x DP = 4) and returns, per rank, the
gathered outputs and gradients; the pytest process computes the references with nn.Linear,
nn.Embedding and F.cross_entropy on the full tensors and compares.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.model.sharding import ShardSpec, global_initial_value, shard, unshard
from megatron_lite.model.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import run_on_ranks
from tests.helpers import gather_pieces
from tests.tolerances import assert_close_relative

S, B, IN, OUT, H = 8, 2, 16, 24, 16  # sequence, batch, linear in/out features, embedding width
VOCAB, DIVISIBLE_BY = 50, 4  # padded to 52 / 56 / 64 rows at TP 1 / 2 / 4
TP_SIZES = (1, 2, 4)

# (bias, tp_chunks, sequence_parallel, gather_output)
COLUMN_CASES = [(True, 1, False, False), (True, 2, False, False), (False, 1, True, False),
                (True, 1, False, True), (True, 2, True, False)]
ROW_CASES = [(True, False), (True, True), (False, False)]  # (bias, sequence_parallel)
CROSS_ENTROPY_CASES = [(0.0, 3.0), (0.1, 3.0), (0.0, 1000.0), (0.2, 1000.0)]  # (label_smoothing, logit scale)


def full_tensors(seed: int, *shapes):
    """Deterministic random tensors, the same in the workers and in the pytest process."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in shapes]





def leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_()


# ---------------------------------------------------------------------------------------------------
# Worker side: the parallel layers


def column_case(pstate, bias, chunks, sequence_parallel, gather_output):
    tp, rank, group = pstate.tp_size, pstate.tp_rank, pstate.group("tp")
    layer = ColumnParallelLinear(IN, OUT, pstate, bias=bias, sequence_parallel=sequence_parallel,
                                 gather_output=gather_output, tp_chunks=chunks)
    weight, bias_full, x, grad_out = full_tensors(1, (OUT, IN), (OUT,), (S, B, IN), (S, B, OUT))
    with torch.no_grad():
        layer.weight.copy_(shard(weight, layer.weight.spec, rank, tp))
        if bias:
            layer.bias.copy_(shard(bias_full, layer.bias.spec, rank, tp))
    x_local = leaf(x.chunk(tp)[rank] if sequence_parallel else x)  # [s/tp, b, in] with SP
    out = layer(x_local)
    out_spec = ShardSpec((S, B, OUT), tp_dim=2, tp_chunks=chunks)
    (out * (grad_out if gather_output else shard(grad_out, out_spec, rank, tp))).sum().backward()
    result = {
        "out": out.detach() if gather_output else unshard(gather_pieces(out, group), out_spec),
        "x_grad": torch.cat(gather_pieces(x_local.grad, group)) if sequence_parallel else x_local.grad,
        "weight_grad": unshard(gather_pieces(layer.weight.grad, group), layer.weight.spec),
    }
    if bias:
        result["bias_grad"] = unshard(gather_pieces(layer.bias.grad, group), layer.bias.spec)
    return result


def row_case(pstate, bias, sequence_parallel):
    tp, rank, group = pstate.tp_size, pstate.tp_rank, pstate.group("tp")
    layer = RowParallelLinear(IN, OUT, pstate, bias=bias, sequence_parallel=sequence_parallel)
    weight, bias_full, x, grad_out = full_tensors(2, (OUT, IN), (OUT,), (S, B, IN), (S, B, OUT))
    with torch.no_grad():
        layer.weight.copy_(shard(weight, layer.weight.spec, rank, tp))
        if bias:
            layer.bias.copy_(bias_full)
    x_local = leaf(x.chunk(tp, dim=-1)[rank])  # [s, b, in/tp]
    out = layer(x_local)  # [s, b, out], or [s/tp, b, out] with SP
    (out * (grad_out.chunk(tp)[rank] if sequence_parallel else grad_out)).sum().backward()
    result = {
        "out": torch.cat(gather_pieces(out, group)) if sequence_parallel else out.detach(),
        "x_grad": torch.cat(gather_pieces(x_local.grad, group), dim=-1),
        "weight_grad": unshard(gather_pieces(layer.weight.grad, group), layer.weight.spec),
    }
    if bias:  # with SP each rank holds the bias gradient of its sequence slice; finalize_grads sums them
        result["bias_grad"] = mappings.all_reduce(layer.bias.grad.clone(), group if sequence_parallel else None)
    return result


def embedding_case(pstate, sequence_parallel):
    tp, rank, group = pstate.tp_size, pstate.tp_rank, pstate.group("tp")
    padded = padded_vocab_size(VOCAB, DIVISIBLE_BY, tp)
    layer = VocabParallelEmbedding(padded, VOCAB, H, pstate, sequence_parallel=sequence_parallel)
    table, grad_out = full_tensors(3, (VOCAB, H), (S, B, H))
    ids = embedding_ids()
    with torch.no_grad():
        layer.weight.copy_(shard(torch.cat([table, torch.zeros(padded - VOCAB, H)]), layer.weight.spec, rank, tp))
    out = layer(ids)  # [s, b, h], or [s/tp, b, h] with SP
    (out * (grad_out.chunk(tp)[rank] if sequence_parallel else grad_out)).sum().backward()
    weight_grad = unshard(gather_pieces(layer.weight.grad, group), layer.weight.spec)
    return {"out": torch.cat(gather_pieces(out, group)) if sequence_parallel else out.detach(),
            "weight_grad": weight_grad[:VOCAB], "padded_rows_grad": weight_grad[VOCAB:]}


def embedding_ids() -> torch.Tensor:
    """[b, s] ids covering both ends of the vocabulary and every TP rank's slice."""
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(4))
    ids[0, :3] = torch.tensor([0, VOCAB - 1, VOCAB // 2])
    return ids


def cross_entropy_inputs(scale: float):
    logits, weights = full_tensors(5, (S, B, VOCAB), (S, B))
    target = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(6))
    target[:2, 0] = torch.tensor([0, VOCAB - 1])
    return logits * scale, target, weights


def cross_entropy_case(pstate, label_smoothing, scale):
    tp, rank, group = pstate.tp_size, pstate.tp_rank, pstate.group("tp")
    padded = padded_vocab_size(VOCAB, DIVISIBLE_BY, tp)
    logits, target, weights = cross_entropy_inputs(scale)
    # Padded columns hold values that would dominate the softmax if they were counted.
    padded_logits = torch.cat([logits, torch.full((S, B, padded - VOCAB), 10.0 * scale)], dim=-1)
    local = leaf(padded_logits.chunk(tp, dim=-1)[rank])  # [s, b, v/tp]
    loss = vocab_parallel_cross_entropy(local, target, pstate, VOCAB, label_smoothing)
    (loss * weights).sum().backward()
    grad = torch.cat(gather_pieces(local.grad, group), dim=-1)
    return {"loss": loss.detach(), "logits_grad": grad[..., :VOCAB], "padded_grad": grad[..., VOCAB:]}


def mapping_cases(pstate):
    """Forward and backward of every region mapping against explicit slicing and summing."""
    tp, rank, group = pstate.tp_size, pstate.tp_rank, pstate.group("tp")
    x, g = full_tensors(7 + rank, (S, B, H), (tp * S, B, tp * H))  # different on every TP rank
    results = {}
    for name in ("copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
                 "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
                 "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
                 "reduce_scatter_to_sequence_parallel_region"):
        x_leaf = leaf(x)
        out = getattr(mappings, name)(x_leaf, group)
        upstream = g[tuple(slice(0, n) for n in out.shape)]
        (out * upstream).sum().backward()
        results[name] = {"out": out.detach(), "grad": x_leaf.grad, "x": x, "upstream": upstream,
                         "all_x": gather_pieces(x, group), "all_upstream": gather_pieces(upstream, group)}
    # Autograd hands one gradient tensor to both sides of a sum: the all-reduce must not change it.
    x_leaf, other = leaf(x), leaf(x)
    (other * 2.0 + mappings.copy_to_tensor_parallel_region(x_leaf, group)).backward(g[:S, :, :H].contiguous())
    results["sibling_grad"] = other.grad
    return results


def run_layer_cases():
    """Every layer case at TP 1, 2 and 4 on this rank of a 4-rank world."""
    results = {}
    for tp in TP_SIZES:
        pstate = ParallelState.build(Layout.from_world(4, tp=tp))
        for case in COLUMN_CASES:
            results[("column", tp, case)] = column_case(pstate, *case)
        for case in ROW_CASES:
            results[("row", tp, case)] = row_case(pstate, *case)
        for sequence_parallel in (False, True):
            results[("embedding", tp, sequence_parallel)] = embedding_case(pstate, sequence_parallel)
        for case in CROSS_ENTROPY_CASES:
            results[("cross_entropy", tp, case)] = cross_entropy_case(pstate, *case)
        results[("mappings", tp)] = (pstate.tp_rank, mapping_cases(pstate))
    return results


# ---------------------------------------------------------------------------------------------------
# Test side: the single-device references


@pytest.fixture(scope="module")
def layer_results():
    return run_on_ranks(4, run_layer_cases)


def close(actual, expected):
    assert_close_relative(actual, expected, rel=1e-5)


def valid_cases(kind, cases):
    return [(tp, case) for tp in TP_SIZES for case in cases if not (tp == 1 and _needs_tp(kind, case))]


def _needs_tp(kind, case):
    return (kind == "column" and case[2]) or (kind == "row" and case[1]) or (kind == "embedding" and case)


@pytest.mark.parametrize(("tp", "case"), valid_cases("column", COLUMN_CASES))
def test_column_parallel_linear_matches_nn_linear(layer_results, tp, case):
    bias = case[0]
    weight, bias_full, x, grad_out = full_tensors(1, (OUT, IN), (OUT,), (S, B, IN), (S, B, OUT))
    reference = torch.nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        reference.weight.copy_(weight)
        if bias:
            reference.bias.copy_(bias_full)
    x = leaf(x)
    out = reference(x)
    (out * grad_out).sum().backward()
    for rank_results in layer_results:
        got = rank_results[("column", tp, case)]
        close(got["out"], out.detach())
        close(got["x_grad"], x.grad)
        close(got["weight_grad"], reference.weight.grad)
        if bias:
            close(got["bias_grad"], reference.bias.grad)


@pytest.mark.parametrize(("tp", "case"), valid_cases("row", ROW_CASES))
def test_row_parallel_linear_matches_nn_linear(layer_results, tp, case):
    bias = case[0]
    weight, bias_full, x, grad_out = full_tensors(2, (OUT, IN), (OUT,), (S, B, IN), (S, B, OUT))
    reference = torch.nn.Linear(IN, OUT, bias=bias)
    with torch.no_grad():
        reference.weight.copy_(weight)
        if bias:
            reference.bias.copy_(bias_full)
    x = leaf(x)
    out = reference(x)
    (out * grad_out).sum().backward()
    for rank_results in layer_results:
        got = rank_results[("row", tp, case)]
        close(got["out"], out.detach())
        close(got["x_grad"], x.grad)
        close(got["weight_grad"], reference.weight.grad)
        if bias:
            close(got["bias_grad"], reference.bias.grad)


@pytest.mark.parametrize(("tp", "sequence_parallel"), valid_cases("embedding", (False, True)))
def test_vocab_parallel_embedding_matches_nn_embedding(layer_results, tp, sequence_parallel):
    table, grad_out = full_tensors(3, (VOCAB, H), (S, B, H))
    reference = torch.nn.Embedding(VOCAB, H)
    with torch.no_grad():
        reference.weight.copy_(table)
    out = reference(embedding_ids().t())  # [s, b, h]
    (out * grad_out).sum().backward()
    for rank_results in layer_results:
        got = rank_results[("embedding", tp, sequence_parallel)]
        close(got["out"], out.detach())
        close(got["weight_grad"], reference.weight.grad)
        assert got["padded_rows_grad"].shape[0] == padded_vocab_size(VOCAB, DIVISIBLE_BY, tp) - VOCAB
        assert torch.count_nonzero(got["padded_rows_grad"]) == 0


@pytest.mark.parametrize(("tp", "case"), valid_cases("cross_entropy", CROSS_ENTROPY_CASES))
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy(layer_results, tp, case):
    label_smoothing, scale = case
    logits, target, weights = cross_entropy_inputs(scale)
    logits = leaf(logits)
    loss = F.cross_entropy(logits.view(-1, VOCAB), target.view(-1), reduction="none",
                           label_smoothing=label_smoothing).view(S, B)
    (loss * weights).sum().backward()
    for rank_results in layer_results:
        got = rank_results[("cross_entropy", tp, case)]
        assert torch.isfinite(got["loss"]).all()
        close(got["loss"], loss.detach())
        close(got["logits_grad"], logits.grad)
        assert torch.count_nonzero(got["padded_grad"]) == 0


@pytest.mark.parametrize("tp", TP_SIZES)
def test_region_mappings_are_the_adjoint_pairs_of_the_design(layer_results, tp):
    for rank_results in layer_results:
        rank, cases = rank_results[("mappings", tp)]
        x, all_x = cases["copy_to_tensor_parallel_region"]["x"], cases["copy_to_tensor_parallel_region"]["all_x"]
        up = {name: c["upstream"] for name, c in cases.items() if name != "sibling_grad"}
        all_up = {name: c["all_upstream"] for name, c in cases.items() if name != "sibling_grad"}
        expected = {  # name: (forward output, gradient of the input)
            "copy_to_tensor_parallel_region": (x, sum(all_up["copy_to_tensor_parallel_region"])),
            "reduce_from_tensor_parallel_region": (sum(all_x), up["reduce_from_tensor_parallel_region"]),
            "scatter_to_tensor_parallel_region": (x.chunk(tp, -1)[rank],
                                                  torch.cat(all_up["scatter_to_tensor_parallel_region"], -1)),
            "gather_from_tensor_parallel_region": (torch.cat(all_x, -1),
                                                   up["gather_from_tensor_parallel_region"].chunk(tp, -1)[rank]),
            "scatter_to_sequence_parallel_region": (x.chunk(tp)[rank],
                                                    torch.cat(all_up["scatter_to_sequence_parallel_region"])),
            "gather_from_sequence_parallel_region": (
                torch.cat(all_x), sum(all_up["gather_from_sequence_parallel_region"]).chunk(tp)[rank]),
            "reduce_scatter_to_sequence_parallel_region": (
                sum(all_x).chunk(tp)[rank], torch.cat(all_up["reduce_scatter_to_sequence_parallel_region"])),
        }
        for name, (out, grad) in expected.items():
            close(cases[name]["out"], out)
            close(cases[name]["grad"], grad)
        close(cases["sibling_grad"], 2.0 * up["copy_to_tensor_parallel_region"])


def test_padded_vocabulary_rows_start_from_the_same_values_whatever_the_padding():
    """The rows of a vocab-padded table must not depend on how much padding the TP size adds."""
    for hidden in (3, 16):
        tables = [global_initial_value(ShardSpec((padded, hidden), tp_dim=0, valid_rows=7), "t", 1, 0.02, 2)
                  for padded in (8, 16)]
        assert torch.equal(tables[0][:7], tables[1][:7])
        assert torch.count_nonzero(tables[1][7:]) == 0


class _NewFullSizeFloatBuffers(TorchDispatchMode):
    """Counts the distinct fp32 tensors of a given number of elements that ops create (in-place results and
    views of an already counted buffer are the same buffer)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel = numel
        self.buffers: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.numel() == self.numel:
                self.buffers.add(tensor.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_works_in_one_fp32_buffer_of_the_logits_size(dtype):
    vocab, padded = 1000, 1024  # padded columns are masked inside the same buffer
    logits = torch.randn(16, 2, padded, dtype=dtype, requires_grad=True)
    target = torch.randint(0, vocab, (16, 2))
    counter = _NewFullSizeFloatBuffers(logits.numel())
    with counter:
        loss = vocab_parallel_cross_entropy(logits, target, ParallelState.single(), vocab)
        loss.sum().backward()
    assert len(counter.buffers) == 1
    reference = F.cross_entropy(logits.detach().float()[..., :vocab].reshape(-1, vocab), target.reshape(-1),
                                reduction="none").view(16, 2)
    assert_close_relative(loss.detach(), reference, rel=1e-5)
