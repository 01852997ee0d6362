"""--optimizer-cpu-offload trains as the optimizer on the device, holds its state on the host, and checkpoints alike.

On the CPU the "device" is the CPU too, but the offloaded masters and moments are separate host tensors that the
gradients are copied into and the weights out of, as on a GPU (optim/cpu_offload.py); the step there is torch's
default CPU AdamW, the device step's own, so offloaded and plain runs agree to the bit. Each run at DP 2 is
compared with the plain optimizer of the same strategy and precision in the same world: losses, gradient norms,
final weights and optimizer state. Checkpoints saved with offload hold the same tensors as without it, and a run
switched between the two at a checkpoint continues bitwise.
"""

from __future__ import annotations

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint.checkpointing import read_checkpoint_tensors
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.model.sharding import FlatShard
from megatron_lite.optim.cpu_offload import offloaded_count
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, gathered_weights, train_steps

VALUES = {**TINY_2_LAYERS, "train_iters": 6}
OFFLOAD = {None: {}, 1.0: {"optimizer_cpu_offload": True},
           0.5: {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5}}
PRECISIONS = {"fp32": {}, "bf16": {"bf16": True},
              # the first steps overflow at this scale and are skipped on every rank, with and without offload
              # (each micro-batch backpropagates its mean loss / 4 micro-batches: 2^7 below its summed loss)
              "fp16": {"fp16": True, "initial_loss_scale": 2.0**23, "hysteresis": 1}}
RUNS = [(strategy, precision) for strategy in ("no_shard", "optim") for precision in ("fp32", "bf16")] + [
    ("optim", "fp16"), ("optim_grads_params", "bf16")]


def train_offloaded(values: dict, world_size: int) -> dict:
    """Train with the real training step; per-step metrics, final weights, optimizer state, and the optimizer
    bytes held on the device and on the host."""
    model, optimizer, history = train_steps(values, world_size)
    state = {key: value.data.clone() if isinstance(value, FlatShard) else value
             for key, value in optimizer.sharded_state_dict().items()}
    model_storages = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.module.parameters()}
    model_storages |= {b.param_shard.untyped_storage().data_ptr() for chunk in model for b in chunk.buckets
                       if b.param_shard is not None}
    host_shares_model_storage = any(m.untyped_storage().data_ptr() in model_storages
                                    for m in (optimizer.host_masters.masters if optimizer.host_masters else []))
    return {"losses": [h["lm_loss"] for h in history], "norms": [h["grad_norm"] for h in history],
            "skipped": sum(h["skipped_iter"] for h in history), "weights": gathered_weights(model), "state": state,
            "device": optimizer.memory_footprint(), "host": optimizer.host_memory_footprint(),
            "stepped": sum(r.stop - r.start for r in optimizer.ranges),
            "offloaded": sum(r.stop - r.start for r in optimizer.host_masters.ranges) if optimizer.host_masters else 0,
            "host_shares_model_storage": host_shares_model_storage}


def train_each_offload(runs: list[tuple[str, str]], world_size: int) -> dict:
    return {(strategy, precision, fraction): train_offloaded(
        {**VALUES, **PRECISIONS[precision], **flags, "data_parallel_sharding_strategy": strategy}, world_size)
        for strategy, precision in runs for fraction, flags in OFFLOAD.items()}


def test_offload_trains_as_the_device_optimizer_at_dp2():
    for rank_results in run_on_ranks(2, train_each_offload, RUNS, 2):
        for strategy, precision in RUNS:
            plain = rank_results[(strategy, precision, None)]
            assert plain["host"] == {"master": 0, "moments": 0, "grads": 0, "outgoing": 0}
            assert (plain["skipped"] > 0) == (precision == "fp16") and plain["skipped"] < len(plain["losses"])
            for fraction in (1.0, 0.5):
                where = f"{strategy} {precision} offload {fraction}"
                run = rank_results[(strategy, precision, fraction)]
                assert run["losses"] == plain["losses"], where
                assert run["norms"] == pytest.approx(plain["norms"], rel=0, abs=0, nan_ok=True), where
                assert run["skipped"] == plain["skipped"], where
                for name, weight in plain["weights"].items():
                    assert torch.equal(run["weights"][name], weight), f"{where} {name}"
                assert run["state"].keys() == plain["state"].keys(), where
                for key, value in plain["state"].items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(run["state"][key], value), (where, key)
                    else:
                        assert run["state"][key] == value, (where, key)
                _assert_state_split(run, plain, fraction, precision, where)


def _assert_state_split(run: dict, plain: dict, fraction: float, precision: str, where: str) -> None:
    """The offloaded share of the elements, and of the optimizer bytes, left the device for the host."""
    share = run["offloaded"] / run["stepped"]
    assert run["stepped"] == plain["stepped"]
    assert share == 1.0 if fraction == 1.0 else 0.25 <= share <= 0.75, where
    assert not run["host_shares_model_storage"], where
    master_bytes = 0 if precision == "fp32" else 4  # an fp32 weight is its own master on the device
    assert run["host"]["moments"] == 8 * run["offloaded"], where
    assert run["host"]["master"] == run["host"]["grads"] == 4 * run["offloaded"], where
    assert run["host"]["outgoing"] == (0 if precision == "fp32" else 2 * run["offloaded"]), where
    assert run["device"]["moments"] == plain["device"]["moments"] - 8 * run["offloaded"], where
    assert run["device"]["master"] == plain["device"]["master"] - master_bytes * run["offloaded"], where


def test_offloaded_share_is_the_prefix_of_ranges_nearest_the_fraction():
    assert offloaded_count([4, 4, 2], 1.0) == 3
    assert offloaded_count([4, 4, 2], 0.0) == 0
    assert offloaded_count([4, 4, 2], 0.5) == 1  # 4 of 10 is nearer 5 than 8 is
    assert offloaded_count([4, 4, 2], 0.7) == 2  # 8 of 10 is nearer 7 than 4 is
    assert offloaded_count([6, 4], 0.3) == 0  # 0 is nearer 3 than 6 is


# ---------------------------------------------------------------------------------------------------------
# Checkpoints

CHECKPOINTED = {**VALUES, "use_distributed_optimizer": True, "train_iters": 8}
# bf16 checkpoints hold the fp32 masters; an fp32 weight is its own master, which a resumed offloaded run must
# take from the loaded model
SWITCHES = {"offload_then_device": ({"bf16": True}, OFFLOAD[1.0], {}),
            "device_then_offload": ({}, {}, OFFLOAD[0.5])}


def pretrain_losses(values: dict, world_size: int) -> list[float]:
    config = make_config(values, world_size)
    return [h["lm_loss"] for h in pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)]


def switch_at_a_checkpoint(root: str, world_size: int) -> dict:
    """Per switch, 8 iterations without offload in one go, and 4 saved in one mode, resumed in the other."""
    runs = {}
    for name, (precision, first, second) in SWITCHES.items():
        values, save = {**CHECKPOINTED, **precision, "save_interval": 4}, f"{root}/{name}"
        runs[name] = pretrain_losses({**values, "save": f"{save}_straight"}, world_size)
        runs[f"{name}_resumed"] = (pretrain_losses({**values, **first, "save": save, "exit_interval": 4}, world_size)
                                   + pretrain_losses({**values, **second, "save": save, "load": save}, world_size))
    return runs


def test_checkpoints_switch_between_offload_and_device_bitwise(tmp_path):
    runs = run_on_ranks(2, switch_at_a_checkpoint, str(tmp_path), 2)[0]
    for name in SWITCHES:
        assert len(runs[f"{name}_resumed"]) == 8 and runs[f"{name}_resumed"] == runs[name], name  # bitwise
        for iteration in (4, 8):  # saved in the first mode and in the second: the same tensors, bitwise
            saved = read_checkpoint_tensors(f"{tmp_path}/{name}/iter_{iteration:07d}")
            reference = read_checkpoint_tensors(f"{tmp_path}/{name}_straight/iter_{iteration:07d}")
            assert saved.keys() == reference.keys(), (name, iteration)
            assert [key for key in saved if not torch.equal(saved[key], reference[key])] == [], (name, iteration)
    masters = read_checkpoint_tensors(f"{tmp_path}/offload_then_device/iter_0000004", "optimizer.state.fp32_param.")
    assert masters  # bf16 weights' masters, saved from the host
    # Resharded: the DP 2 checkpoint saved with offload resumes on one rank with half of the state offloaded.
    resumed = pretrain_losses({**CHECKPOINTED, "bf16": True, **OFFLOAD[0.5],
                               "load": f"{tmp_path}/offload_then_device", "ckpt_step": 4}, 1)
    assert resumed == pytest.approx(runs["offload_then_device"][4:], rel=1e-5)


def test_weights_loaded_without_optimizer_state_become_the_host_masters(tmp_path):
    values = {**CHECKPOINTED, "use_distributed_optimizer": False, "bf16": True, "global_batch_size": 2,
              "train_iters": 2}
    pretrain_losses({**values, "save": str(tmp_path)}, 1)
    plain, offloaded = (pretrain_losses({**values, **flags, "load": str(tmp_path), "no_load_optim": True,
                                         "train_iters": 4}, 1) for flags in (OFFLOAD[None], OFFLOAD[1.0]))
    assert len(offloaded) == 2 and offloaded == plain  # bitwise: fresh moments, masters from the loaded weights


# ---------------------------------------------------------------------------------------------------------
# Refused combinations

@pytest.mark.parametrize("flags, message", [
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.5},
     "--optimizer-offload-fraction (1.5) must be between 0 and 1"),
    ({"optimizer_cpu_offload": True, "optimizer_offload_fraction": -0.1},
     "--optimizer-offload-fraction (-0.1) must be between 0 and 1"),
    ({"optimizer_offload_fraction": 0.5}, "--optimizer-offload-fraction acts only with --optimizer-cpu-offload; add "
                                          "that or drop --optimizer-offload-fraction"),
])
def test_bad_offload_flags_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError) as error:
        make_config({**VALUES, **flags})
    assert str(error.value) == message
