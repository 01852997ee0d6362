"""Dropout randomness under tensor parallelism: shared outside TP regions, per TP rank inside, reproducible.

On a 4-rank world as TP2 x DP2: the default stream draws the same numbers on every rank and the
tracker's stream differs between TP ranks (and is shared by the data-parallel replicas of a TP rank);
forking leaves the default stream where it was; a rebuilt tracker repeats itself. In a model with
dropout, the residual stream stays identical on the TP ranks without sequence parallelism, and
activation recomputation replays exactly the masks of the first forward pass.
"""

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_split import ChunkPlan, model_chunk_plans
from megatron_lite.model.attention.self_attention import CoreAttention
from megatron_lite.model.sharding import unshard
from megatron_lite.model.transformer import HiddenDropout
from megatron_lite.parallel.random import RNGTracker, set_random_seed
from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import run_on_ranks
from tests.helpers import gather_pieces
from tests.tolerances import assert_close_relative

SEED = 1234
DROPOUT_MODEL = {"model_preset": "gpt2-124m", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                 "ffn_hidden_size": 128, "seq_length": 16, "max_position_embeddings": 16, "vocab_size": 96,
                 "mock_data": True, "hidden_dropout": 0.2, "attention_dropout": 0.2,
                 "tensor_model_parallel_size": 2}


def draws(pstate):
    set_random_seed(SEED, pstate.pp_rank)
    tracker = RNGTracker(SEED, pstate.tp_rank, pstate.pp_rank, torch.device("cpu"))
    first = torch.rand(8)
    with tracker.fork():
        tensor_parallel = torch.rand(8)
    second = torch.rand(8)
    with tracker.fork():
        tensor_parallel_next = torch.rand(8)
    set_random_seed(SEED, pstate.pp_rank)
    default_without_fork = torch.rand(16)
    masks = {}
    for sp in (False, True):
        rebuilt = RNGTracker(SEED, pstate.tp_rank, pstate.pp_rank, torch.device("cpu"))
        masks[sp] = HiddenDropout(0.5, rebuilt, sequence_parallel=sp)(torch.ones(64)) != 0
    # Each TP rank's attention heads are different heads: their dropout must not repeat across ranks.
    q, k, v = torch.randn(3, 8, 2, 2, 4, generator=torch.Generator().manual_seed(0))  # [s, b, heads, d]
    core = CoreAttention(0.5, "sdpa", RNGTracker(SEED, pstate.tp_rank, pstate.pp_rank, torch.device("cpu")))
    return {"first": first, "second": second, "tensor_parallel": tensor_parallel,
            "tensor_parallel_next": tensor_parallel_next, "default_without_fork": default_without_fork,
            "masks": masks, "attention": core(q, k, v), "tp_rank": pstate.tp_rank}


def dropout_model_step(pstate, values: dict):
    """Hidden states and gathered gradients of a training step with dropout."""
    config = make_config(values, 4)
    set_random_seed(config.training.seed, pstate.pp_rank)
    model = pretrain_gpt.model_provider(config, pstate, model_chunk_plans(config, 0)[0], torch.device("cpu"))
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    model.train()
    hidden = model.decoder(model.embedding(tokens[:, :-1], torch.arange(16)), None)  # [s(/tp), b, h]
    model(tokens[:, :-1], torch.arange(16), labels=tokens[:, 1:]).sum().backward()
    group = pstate.group("tp")
    grads = {name: unshard(gather_pieces(p.grad, group), p.spec) for name, p in model.named_global_parameters()}
    return hidden.detach(), grads


def run_random_cases():
    pstate = ParallelState.build(Layout.from_world(4, tp=2))
    results = {"draws": draws(pstate)}
    for sp in (False, True):
        for recompute in (None, "full", "selective"):
            values = {**DROPOUT_MODEL, "sequence_parallel": sp, "recompute_granularity": recompute}
            results[(sp, recompute)] = dropout_model_step(pstate, values)
    return results


@pytest.fixture(scope="module")
def random_results():
    return run_on_ranks(4, run_random_cases)


def test_default_stream_is_shared_and_tracker_stream_differs_per_tp_rank(random_results):
    by_tp_rank = {}
    for result in random_results:
        by_tp_rank.setdefault(result["draws"]["tp_rank"], []).append(result["draws"])
    for replicas in by_tp_rank.values():  # data-parallel replicas of one TP rank draw alike
        for other in replicas[1:]:
            assert torch.equal(other["tensor_parallel"], replicas[0]["tensor_parallel"])
    zero, one = by_tp_rank[0][0], by_tp_rank[1][0]
    assert not torch.equal(zero["tensor_parallel"], one["tensor_parallel"])
    assert not torch.equal(zero["tensor_parallel"], zero["tensor_parallel_next"])  # the stream advances
    for result in random_results:
        draws = result["draws"]
        assert torch.equal(draws["first"], zero["first"]) and torch.equal(draws["second"], zero["second"])
        # Forking neither consumed nor reset the default stream.
        assert torch.equal(torch.cat([draws["first"], draws["second"]]), draws["default_without_fork"])


def test_dropout_masks_are_shared_outside_tp_regions_and_differ_inside(random_results):
    zero = next(r["draws"] for r in random_results if r["draws"]["tp_rank"] == 0)
    for result in random_results:
        draws = result["draws"]
        assert torch.equal(draws["masks"][False], zero["masks"][False])
        same_tp_rank = draws["tp_rank"] == 0  # else the sequence slices and heads draw apart
        assert torch.equal(draws["masks"][True], zero["masks"][True]) == same_tp_rank
        assert torch.equal(draws["attention"], zero["attention"]) == same_tp_rank


def test_residual_stream_stays_identical_on_tp_ranks_with_dropout(random_results):
    hidden = [result[(False, None)][0] for result in random_results]
    for other in hidden[1:]:
        assert torch.equal(other, hidden[0])


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recomputation_replays_the_dropout_masks(random_results, sequence_parallel, recompute):
    for result in random_results:
        hidden, grads = result[(sequence_parallel, None)]
        recomputed_hidden, recomputed_grads = result[(sequence_parallel, recompute)]
        assert torch.equal(recomputed_hidden, hidden)
        for name, grad in grads.items():
            assert_close_relative(recomputed_grads[name], grad, rel=1e-6, msg=name)


def test_model_chunks_of_one_rank_draw_different_tensor_parallel_streams():
    """Virtual pipeline stages: two chunks on one rank must not repeat each other's dropout masks."""
    config = make_config({**DROPOUT_MODEL, "tensor_model_parallel_size": 1, "num_layers": 4}, 1)
    chunks = [pretrain_gpt.model_provider(config, ParallelState.single(), plan, torch.device("cpu"))
              for plan in (ChunkPlan(0, 2, True, False), ChunkPlan(2, 2, False, True))]
    draws = []
    for chunk in chunks:
        with chunk.decoder.rng_tracker.fork():
            draws.append(torch.rand(8))
    assert not torch.equal(draws[0], draws[1])
