"""Initial weights: each element a pure function of (seed, global name, global index), so every layout starts from
the single-device weights while a rank computes only the elements it holds; a resumed run computes none."""

import math

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.model import sharding
from megatron_lite.model.sharding import ShardSpec, draw_normal_shard, global_initial_value, shard
from megatron_lite.parallel.state import TensorSplit
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks
from tests.helpers import build_run

SPECS = {"column, fused [gate; up]": ShardSpec((48, 20), tp_dim=0, tp_chunks=2),
         "row": ShardSpec((12, 40), tp_dim=1),
         "vocabulary with padding": ShardSpec((56, 8), tp_dim=0, valid_rows=37),
         "vector": ShardSpec((32,), tp_dim=0)}


@pytest.mark.parametrize("name", list(SPECS))
def test_every_tensor_parallel_shard_is_the_cut_of_the_global_tensor(name):
    spec = SPECS[name]
    full = global_initial_value(spec, "decoder.layers.0.w", 7, 0.02, 2)
    for tp_size in (2, 4):
        for tp_rank in range(tp_size):
            local = list(spec.global_shape)
            local[spec.tp_dim] //= tp_size
            drawn = torch.empty(local)
            draw_normal_shard(drawn, spec, "decoder.layers.0.w", 7, 0.02, tp_rank, tp_size)
            assert torch.equal(drawn, shard(full, spec, tp_rank, tp_size)), (name, tp_size, tp_rank)


def test_padding_rows_are_zero_and_leave_the_real_rows_unchanged():
    small = global_initial_value(ShardSpec((40, 8), tp_dim=0, valid_rows=37), "embedding", 1, 0.02, 2)
    large = global_initial_value(ShardSpec((64, 8), tp_dim=0, valid_rows=37), "embedding", 1, 0.02, 2)
    assert torch.equal(small[:37], large[:37]) and not large[37:].any() and not small[37:].any()


def test_values_are_normal_with_the_asked_scale_and_differ_by_name_and_seed():
    spec = ShardSpec((1000, 1000))
    values = global_initial_value(spec, "w", 3, 0.02, 2).double().flatten()
    n = values.numel()
    assert abs(values.mean().item()) < 5 * 0.02 / math.sqrt(n)  # five standard errors
    assert abs(values.std().item() / 0.02 - 1) < 5 * math.sqrt(0.5 / n)
    standardised = values / 0.02
    assert abs((standardised**4).mean().item() - 3.0) < 5 * math.sqrt(96 / n)  # the normal's kurtosis
    assert abs((standardised.abs() < 1).double().mean().item() - math.erf(1 / math.sqrt(2))) < 5 * 0.5 / math.sqrt(n)
    neighbours = torch.corrcoef(torch.stack([standardised[:-1], standardised[1:]]))[0, 1].item()
    assert abs(neighbours) < 5 / math.sqrt(n)
    scaled = global_initial_value(ShardSpec((1000, 1000), init="scaled_normal"), "w", 3, 0.02, 8)
    assert torch.allclose(scaled, (values / math.sqrt(16)).float().view(1000, 1000))
    assert not torch.equal(global_initial_value(spec, "v", 3, 0.02, 2), global_initial_value(spec, "w", 3, 0.02, 2))
    assert not torch.equal(global_initial_value(spec, "w", 4, 0.02, 2), global_initial_value(spec, "w", 3, 0.02, 2))


TP2 = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
       "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 60, "seq_length": 16,
       "max_position_embeddings": 16, "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 2,
       "untie_embeddings_and_output_weights": True, "tensor_model_parallel_size": 2, "swiglu": True}


def _drawn_and_held(values: dict, world_size: int) -> tuple[int, int, int]:
    """Elements this rank drew; elements of its randomly initialised parameters; of those, the ones outside the
    vocabulary padding (whose rows grow with the TP size)."""
    with sharding.recorded_draws() as draws:
        config, pstate, _, model, _ = build_run(values, world_size)
    drawn_params = [p for chunk in model for p in chunk.module.parameters() if p.spec.init in ("normal",
                                                                                             "scaled_normal")]
    rows_per_rank = config.model.vocab_size  # padded rows are zero; count the real ones of this rank's slice
    real = 0
    for p in drawn_params:
        if p.spec.valid_rows is None:
            real += p.numel()
        else:
            first = pstate.tp_rank * p.shape[0]
            real += max(0, min(p.shape[0], rows_per_rank - first)) * p.shape[1]
    return sum(elements for _, elements in draws), sum(p.numel() for p in drawn_params), real


def test_a_rank_draws_exactly_the_elements_it_holds():
    per_rank = run_on_ranks(2, _drawn_and_held, TP2, 2)
    for drawn, held, _ in per_rank:
        assert drawn == held, per_rank
    _, _, single_real = _drawn_and_held({**TP2, "tensor_model_parallel_size": 1}, 1)
    assert sum(real for _, _, real in per_rank) == single_real  # no element drawn on two TP ranks, none left out


def test_a_resumed_run_draws_nothing_and_trains_as_the_uninterrupted_one(tmp_path):
    values = {**TP2, "tensor_model_parallel_size": 1, "train_iters": 4, "lr_decay_iters": 4, "hidden_dropout": 0.1}
    uninterrupted = pretrain(make_config(values), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    save = str(tmp_path / "ckpt")
    pretrain(make_config({**values, "train_iters": 2, "save": save}), pretrain_gpt.model_provider,
             pretrain_gpt.forward_step)
    with sharding.recorded_draws() as draws:
        resumed = pretrain(make_config({**values, "load": save}), pretrain_gpt.model_provider,
                           pretrain_gpt.forward_step)
    assert draws == []
    assert [(h["lm_loss"], h["grad_norm"]) for h in resumed] == [(h["lm_loss"], h["grad_norm"])
                                                                  for h in uninterrupted[2:]]


def test_a_skipped_initialization_leaves_zeros_for_what_no_checkpoint_holds():
    """The vocabulary padding rows (their number depends on the TP size) are in no checkpoint: a model built to
    be loaded must hold zeros there, as a fresh draw does, not whatever the allocator returned."""
    _, _, _, model, _ = build_run({**TP2, "tensor_model_parallel_size": 1}, 1)
    named = [(name, param) for chunk in model for name, param in chunk.module.named_global_parameters()]
    assert any(param.abs().sum() > 0 for _, param in named)
    with sharding.initialization_skipped():
        sharding.initialize_parameters(named, 1234, 0.02, 2, TensorSplit())
    assert all(not param.any() for _, param in named)
