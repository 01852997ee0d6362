"""The collectives tensor parallelism issues per step are exactly those of Megatron's design.

One transformer layer, forward then backward: without sequence parallelism one all-reduce per block
(attention, MLP) in each direction, so 2 + 2; with sequence parallelism each all-reduce becomes an
all-gather before the column-parallel layer and a reduce-scatter after the row-parallel one, in both
directions, moving the same bytes. The whole model adds the embedding's reduction, the output layer's
entry into the TP region, and the three all-reduces of the vocab-parallel cross-entropy (max, target
logit, sum of exponentials) without ever gathering the logits. Every torch.distributed collective is
wrapped while the step runs, so a stray one anywhere is counted too.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.model.attention.self_attention import RotaryEmbedding
from megatron_lite.model.sharding import initialize_parameters
from megatron_lite.model.transformer import TransformerLayer
from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import run_on_ranks

S, B = 16, 2
BASE = {"num_layers": 2, "hidden_size": 64, "seq_length": S, "max_position_embeddings": S, "vocab_size": 100,
        "mock_data": True, "hidden_dropout": 0.0, "attention_dropout": 0.0, "num_attention_heads": 8}
MODELS = {"gpt2": {**BASE, "model_preset": "gpt2-124m", "ffn_hidden_size": 128},
          "llama_gqa": {**BASE, "model_preset": "llama-tiny", "num_query_groups": 4, "ffn_hidden_size": 96}}
CASES = [(name, tp, sp) for name in MODELS for tp in (2, 4) for sp in (False, True)]
COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_gather", "reduce_scatter", "broadcast", "all_to_all_single",
               "all_to_all", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier")


# The flat (single-tensor) all-gather and reduce-scatter have new names from torch 2.13; count either as one.
FLAT = {"all_gather_single": "all_gather_flat", "all_gather_into_tensor": "all_gather_flat",
        "reduce_scatter_single": "reduce_scatter_flat", "reduce_scatter_tensor": "reduce_scatter_flat"}


@contextlib.contextmanager
def counting_collectives(log: list):
    """Record (name, elements of the input tensor) for every collective called."""
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counted(name, original):
        def call(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            sent = tensors[-1] if name in FLAT else tensors[0]  # the flat forms take (output, input)
            log.append((FLAT.get(name, name), sent.numel()))
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def count_layer_step(values: dict, pstate: ParallelState, sp: bool) -> tuple[list, list]:
    """Collectives of one TransformerLayer's forward and of its backward."""
    config = make_config(values, 4).model
    layer = TransformerLayer(config, pstate, 0, sequence_parallel=sp, attention_backend="sdpa", rng_tracker=None)
    initialize_parameters(layer.named_parameters(), 1, 0.02, 2, pstate.tensor_split)
    x = torch.randn(S // pstate.tp_size if sp else S, B, config.hidden_size, requires_grad=True)
    rotary = RotaryEmbedding(config.head_dim, config.rotary_base)(torch.arange(S)) \
        if config.position_embedding_type == "rope" else None
    forward, backward = [], []
    with counting_collectives(forward):
        out = layer(x, rotary)
    with counting_collectives(backward):
        out.backward(torch.randn_like(out))
    return forward, backward


def count_model_step(values: dict, pstate: ParallelState) -> tuple[list, list]:
    """Collectives of the whole model's forward (to the per-token loss) and of its backward."""
    config = make_config(values, 4)
    model = pretrain_gpt.model_provider(config, pstate, model_chunk_plans(config, 0)[0], torch.device("cpu"))
    tokens = torch.randint(0, 100, (B, S + 1), generator=torch.Generator().manual_seed(0))
    forward, backward = [], []
    with counting_collectives(forward):
        loss = model(tokens[:, :-1], torch.arange(S), labels=tokens[:, 1:])
    with counting_collectives(backward):
        loss.sum().backward()
    return forward, backward


def run_counts():
    results = {}
    for tp in (2, 4):
        pstate = ParallelState.build(Layout.from_world(4, tp=tp))
        for name, values in MODELS.items():
            for sp in (False, True):
                layout = {**values, "tensor_model_parallel_size": tp, "sequence_parallel": sp}
                results[("layer", name, tp, sp)] = count_layer_step(layout, pstate, sp)
                results[("model", name, tp, sp)] = count_model_step(layout, pstate)
    return results


@pytest.fixture(scope="module")
def counts():
    return run_on_ranks(4, run_counts)


H = BASE["hidden_size"]
ALL_REDUCE = ("all_reduce", S * B * H)


def all_gather(tp):
    return "all_gather_flat", S // tp * B * H  # each rank sends its [s/tp, b, h] slice


def reduce_scatter(tp):
    return "reduce_scatter_flat", S * B * H  # each rank sends its [s, b, h] partial sums


@pytest.mark.parametrize(("name", "tp", "sp"), CASES)
def test_layer_issues_two_reductions_per_direction(counts, name, tp, sp):
    expected = [all_gather(tp), reduce_scatter(tp)] * 2 if sp else [ALL_REDUCE] * 2
    for rank_counts in counts:
        forward, backward = rank_counts[("layer", name, tp, sp)]
        assert forward == expected
        assert backward == expected


@pytest.mark.parametrize(("name", "tp", "sp"), CASES)
def test_model_adds_embedding_output_layer_and_three_cross_entropy_all_reduces(counts, name, tp, sp):
    layers = BASE["num_layers"]
    tokens = S * B
    cross_entropy = [("all_reduce", tokens)] * 3  # max, target logit, sum of exponentials: [s, b] each
    if sp:
        forward = [reduce_scatter(tp)] + [all_gather(tp), reduce_scatter(tp)] * 2 * layers + [all_gather(tp)]
        backward = [reduce_scatter(tp)] + [all_gather(tp), reduce_scatter(tp)] * 2 * layers + [all_gather(tp)]
    else:
        forward = [ALL_REDUCE] * (1 + 2 * layers)
        backward = [ALL_REDUCE] * (1 + 2 * layers)
    for rank_counts in counts:
        got_forward, got_backward = rank_counts[("model", name, tp, sp)]
        assert got_forward == forward + cross_entropy
        assert got_backward == backward
