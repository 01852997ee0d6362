"""ZeRO-1/2/3 train as the plain optimizer does, at DP 2 and 4, with TP 2 (+SP, recomputation) and PP 2.

Every layout runs 4 steps (a warm-up step, then three with Adam's state) with each sharding strategy in one
spawned world (the sharded ones at DP 4 and PP 2 with --overlap-grad-reduce and --overlap-param-gather).
Against no_shard in the same world: losses and gradient norms to rel 1e-6, final weights to rel 1e-6 for
ZeRO-1 and 3e-5 for ZeRO-2/3 (L2 per parameter, see WEIGHT_TOLERANCE). Against one device: the gradient norms
to rel 1e-5 (clipping is active: clip-grad is below every norm), and the optimizer state assembled from every
rank's FlatShards. Per-rank memory of each category is the theory for the layout; sharded runs evaluate and
log as no_shard does.
"""

from __future__ import annotations

import json

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import (
    build_data_iterator,
    build_datasets,
    pretrain,
    train_step,
)
from tests.harness import run_on_ranks
from tests.helpers import EQUIVALENCE_ITERS, TINY_2_LAYERS, build_run, train_with_state
from tests.tolerances import assert_close_in_norm

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OVERLAP = {"overlap_grad_reduce": True, "overlap_param_gather": True}
# ZeRO-1 reduces the same sums as no_shard. ZeRO-2/3 reduce-scatter every micro-batch, summing the same
# gradients in another order; where micro-batch gradients nearly cancel, Adam's update carries that
# rounding further: up to 1e-5 here, less than no_shard's own distance from one device (2e-5, PP2 tied).
WEIGHT_TOLERANCE = {"optim": 1e-6, "optim_grads": 3e-5, "optim_grads_params": 3e-5}
TRAIN = {**TINY_2_LAYERS, "train_iters": EQUIVALENCE_ITERS}


def train_every_strategy(values: dict, world_size: int, overlap: bool = False) -> dict:
    """One run per sharding strategy; with `overlap`, the sharded ones overlap reduction and gathering."""
    return {strategy: train_with_state({**values, "data_parallel_sharding_strategy": strategy,
                             **(OVERLAP if overlap and strategy != "no_shard" else {})}, world_size)
            for strategy in STRATEGIES}


def assemble_state(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Global optimizer tensors (each parameter's TP shard flattened) from every rank's FlatShards,
    checking that replicas agree and that the pieces cover every element."""
    from megatron_lite.model.sharding import unshard

    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for result in ranks:
        tp_rank, tp_size = result["tp"]
        for key, value in result["state"].items():
            if not isinstance(value, tuple):
                continue
            data, (start, stop), spec = value
            local_numel = torch.Size(spec.global_shape).numel() // (tp_size if spec.tp_dim is not None else 1)
            flat = pieces.setdefault(key, {}).setdefault(tp_rank, torch.full((local_numel,), float("nan")))
            seen = flat[start:stop]
            assert torch.isnan(seen).all() or torch.equal(seen, data), f"replicas of {key} disagree"
            flat[start:stop] = data
            pieces[key]["spec"] = spec
    full = {}
    for key, by_rank in pieces.items():
        spec = by_rank.pop("spec")
        local_shape = list(spec.global_shape)
        if spec.tp_dim is not None:
            local_shape[spec.tp_dim] //= len(by_rank)
        tensor = unshard([by_rank[r].view(local_shape) for r in sorted(by_rank)], spec)
        assert not torch.isnan(tensor).any(), f"{key} is not covered by the ranks' shards"
        full[key] = tensor
    return full


def assert_weights_close(actual: dict, expected: dict, rel: float) -> None:
    """Per parameter, |actual - expected| <= rel |expected| (L2 norms: a few elements near zero may differ
    more, as Adam divides by their small second moments)."""
    for name, weight in expected.items():
        difference = float((actual[name] - weight).norm() / weight.norm())
        assert difference <= rel, f"{name}: relative difference {difference:.2e}"


def check_against_plain(results_of_ranks: list[dict], reference: dict) -> None:
    """Every rank, every strategy: equal to no_shard in the same world (rel 1e-6) and to one device."""
    for result in results_of_ranks:
        plain = result["no_shard"]
        assert plain["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        for strategy in STRATEGIES[1:]:
            sharded = result[strategy]
            assert sharded["losses"] == pytest.approx(plain["losses"], rel=1e-6), strategy
            assert sharded["norms"] == pytest.approx(plain["norms"], rel=1e-6), strategy
            assert sharded["norms"] == pytest.approx(reference["norms"], rel=1e-5), strategy
            assert_weights_close(sharded["weights"], plain["weights"], WEIGHT_TOLERANCE[strategy])
    assert min(reference["norms"]) > TRAIN["clip_grad"]  # clipping is active in every step
    assert reference["losses"][-1] < reference["losses"][0]


def check_state_against_single_device(results_of_ranks: list[dict], reference: dict) -> None:
    """The optimizer state assembled from all ranks' FlatShards is the single-device optimizer's."""
    reference_state = assemble_state([reference])
    for strategy in STRATEGIES:
        state = assemble_state([r[strategy] for r in results_of_ranks])
        assert state.keys() == reference_state.keys()
        for key, tensor in state.items():
            # L2 per tensor, as the weights: no_shard is within 2e-5 of one device (WEIGHT_TOLERANCE)
            assert_close_in_norm(tensor, reference_state[key], rel=3e-5, msg=f"{strategy} {key}")
        assert all(r[strategy]["state"]["optimizer.step"] == TRAIN["train_iters"] for r in results_of_ranks)


def test_zero_1_2_3_at_dp2_equal_the_plain_optimizer():
    reference = train_with_state(TRAIN, 1)
    results = run_on_ranks(2, train_every_strategy, TRAIN, 2)
    check_against_plain(results, reference)
    check_state_against_single_device(results, reference)


TP2 = {**TRAIN, "tensor_model_parallel_size": 2, "sequence_parallel": True, "recompute_granularity": "full"}
TIED = {**TRAIN, "untie_embeddings_and_output_weights": False}
PP2_TIED = {**TIED, "pipeline_model_parallel_size": 2}


def train_layouts_on_four_ranks() -> dict:
    return {"dp4": train_every_strategy(TRAIN, 4, overlap=True), "tp2": train_every_strategy(TP2, 4),
            "pp2": train_every_strategy(PP2_TIED, 4, overlap=True)}


def test_zero_1_2_3_at_dp4_and_with_tp2_sp_recompute_and_pp2_tied_equal_the_plain_optimizer():
    reference, tied_reference = train_with_state(TRAIN, 1), train_with_state(TIED, 1)
    results = run_on_ranks(4, train_layouts_on_four_ranks)
    for layout, layout_reference in (("dp4", reference), ("tp2", reference), ("pp2", tied_reference)):
        check_against_plain([r[layout] for r in results], layout_reference)
        check_state_against_single_device([r[layout] for r in results], layout_reference)


# ---------------------------------------------------------------------------------------------------------
# Memory per rank

# Bytes per parameter held between steps with bf16 weights, by category and sharding strategy: (bytes, whether
# divided by the data-parallel size d). 18 bytes unsharded; ZeRO-1 6 + 12/d; ZeRO-2 2 + 16/d; ZeRO-3 18/d.
THEORY = {
    "no_shard": {"params": (2, False), "grads": (4, False), "master": (4, False), "moments": (8, False)},
    "optim": {"params": (2, False), "grads": (4, False), "master": (4, True), "moments": (8, True)},
    "optim_grads": {"params": (2, False), "grads": (4, True), "master": (4, True), "moments": (8, True)},
    "optim_grads_params": {"params": (2, True), "grads": (4, True), "master": (4, True), "moments": (8, True)},
}


def held_bytes(*roots) -> int:
    """Bytes of the distinct tensor storages reachable from `roots` through object attributes, containers,
    module parameters, tensor attributes (main_grad) and optimizer state: what these objects keep alive,
    found without asking them."""
    seen, storages, stack = set(), {}, list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            stack.extend(vars(obj).values())
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("megatron_lite", "torch.nn", "torch.optim")) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def memory_of_every_strategy(values: dict, world_size: int) -> dict:
    """Per strategy, after one bf16 step: the bytes each category holds, the bytes reachable from model and
    optimizer, the local parameter count, the number of buckets and the step's loss."""
    out = {}
    for strategy in STRATEGIES:
        config, pstate, device, model, optimizer = build_run(
            {**values, "data_parallel_sharding_strategy": strategy, "bf16": True}, world_size)
        iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
        loss = train_step(pretrain_gpt.forward_step, iterator, model, optimizer, config, pstate, 0, device)["lm_loss"]
        measured = optimizer.memory_footprint()
        for chunk in model:
            for kind, size in chunk.memory_footprint().items():
                measured[kind] = measured.get(kind, 0) + size
        out[strategy] = {"measured": measured, "held": held_bytes(model, optimizer), "loss": loss,
                         "numel": sum(p.numel() for chunk in model for p in chunk.module.parameters()),
                         "buckets": sum(len(chunk.buckets) for chunk in model), "d": pstate.dp_size,
                         "dtypes": {str(p.dtype) for chunk in model for p in chunk.module.parameters()}}
    return out


def test_per_rank_memory_of_each_zero_stage_matches_theory():
    results = run_on_ranks(4, memory_of_every_strategy, {**TINY_2_LAYERS, "train_iters": 1, "lr_warmup_iters": 0}, 4)
    for rank_result in results:
        for strategy, r in rank_result.items():
            n, d = r["numel"], r["d"]
            assert d == 4 and r["dtypes"] == {"torch.bfloat16"}
            for kind, (per_param, sharded) in THEORY[strategy].items():
                theory = per_param * n / (d if sharded else 1)
                padding = per_param * d * r["buckets"]  # each bucket is padded by fewer than d elements
                assert 0.95 * theory - padding <= r["measured"][kind] <= 1.05 * theory + padding, (strategy, kind)
            # Nothing else of size is held: the four categories are all the model and optimizer keep.
            assert r["held"] <= 1.02 * sum(r["measured"].values()) + 64 * 1024, strategy
            assert r["loss"] == pytest.approx(rank_result["no_shard"]["loss"], rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Through training.pretrain: evaluation and logging


def pretrain_logging_to(values: dict, world_size: int, path: str) -> None:
    pretrain(make_config({**values, "metrics_jsonl": path}, world_size), pretrain_gpt.model_provider,
             pretrain_gpt.forward_step)


def test_sharded_runs_evaluate_and_log_as_no_shard(tmp_path):
    values = {**TINY_2_LAYERS, "train_iters": 4, "eval_interval": 2, "eval_iters": 2}
    records = {}
    for strategy, flags in (("no_shard", {}), ("optim", OVERLAP), ("optim_grads_params", OVERLAP)):
        path = tmp_path / f"{strategy}.jsonl"
        run_on_ranks(2, pretrain_logging_to, {**values, **flags, "data_parallel_sharding_strategy": strategy}, 2,
                     str(path))
        records[strategy] = [json.loads(line) for line in path.read_text().splitlines()]
    plain = records["no_shard"]
    assert [r["valid_lm_loss"] for r in plain if "valid_lm_loss" in r] and all(r.get("skipped_iter", 0) == 0
                                                                               for r in plain)
    for strategy in ("optim", "optim_grads_params"):
        assert len(records[strategy]) == len(plain)
        for record, expected in zip(records[strategy], plain):
            for key in ("lm_loss", "grad_norm", "valid_lm_loss", "loss_scale", "skipped_iter"):
                if key in expected:
                    assert record[key] == pytest.approx(expected[key], rel=1e-6), (strategy, key)


def test_zero3_gathers_one_layer_at_a_time_in_forward_and_backward():
    config, pstate, device, (chunk,), optimizer = build_run(
        {**TINY_2_LAYERS, "num_layers": 3, "data_parallel_sharding_strategy": "optim_grads_params"}, 1)
    layers = list(chunk.module.decoder.layers)

    def gathered() -> set[int]:
        return {i for i, layer in enumerate(layers) if layer.mlp.linear_fc1.weight.untyped_storage().nbytes() > 0}

    seen = []

    def record(kind: str, index: int) -> None:
        seen.append((kind, index, gathered()))

    for index, layer in enumerate(layers):  # registered after the wrapper's hooks, so they run after them
        layer.register_forward_pre_hook(lambda module, args, index=index: record("forward", index))
        for param in layer.parameters():
            param.register_post_accumulate_grad_hook(lambda p, index=index: record("backward", index))
    iterator = build_data_iterator(build_datasets(config)[0], config, pstate, 0)
    train_step(pretrain_gpt.forward_step, iterator, [chunk], optimizer, config, pstate, 0, device)
    assert [(kind, index, layers_gathered) for kind, index, layers_gathered in seen if kind == "forward"] == [
        ("forward", i, {i}) for i in range(3)] * config.num_microbatches
    backward = [(index, layers_gathered) for kind, index, layers_gathered in seen if kind == "backward"]
    first_of_each_layer = [record for n, record in enumerate(backward) if n == 0 or backward[n - 1][0] != record[0]]
    assert first_of_each_layer == [(i, {i}) for i in (2, 1, 0)] * config.num_microbatches
    assert all(layers_gathered <= {index} for index, layers_gathered in backward)  # freed once complete
    assert gathered() == set()
    numel = sum(p.numel() for p in chunk.module.parameters())
    assert chunk.memory_footprint()["params"] < 4 * numel * 1.01  # the shards only (d = 1: all of it, once)
