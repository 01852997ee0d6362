"""Every loss that enters the backward (the LM loss, each multi-token prediction depth's, the MoE auxiliary and
z-losses) is judged by --check-for-nan-in-loss-and-grad, the spike check and the rerun machine: a non-finite one
stops the run before its step, named, with nothing after the last good iteration saved."""

import dataclasses
import math

import pytest
import torch

import pretrain_gpt
from megatron_lite.checkpoint import directory
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.errors import TrainingDivergedError
from megatron_lite.model.moe.router import TopKRouter
from megatron_lite.model.mtp import MultiTokenPredictionLayer
from megatron_lite.training import rerun_state_machine
from megatron_lite.training.loop import pretrain
from megatron_lite.training.rerun_state_machine import RerunStateMachine, Result

MOE_MTP = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
           "num_attention_heads": 2, "num_query_groups": 2, "vocab_size": 64, "seq_length": 16,
           "max_position_embeddings": 16, "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
           "moe_aux_loss_coeff": 1e-2, "moe_z_loss_coeff": 1e-3, "mtp_num_layers": 2, "micro_batch_size": 2,
           "global_batch_size": 4, "train_iters": 4, "lr": 1e-3, "eval_interval": 1000, "log_interval": 1}
ALL_LOSSES = ["lm loss", "mtp 1 loss", "mtp 2 loss", "moe aux loss", "moe z loss"]
NAN_FROM_CALL = 4  # from the 5th forward of a module on: iteration 3 of 2 micro-batches, and its rerun


def _nan_after(calls: list[int], change):
    """A forward hook turning a module's output non-finite from its NAN_FROM_CALL-th call on."""
    def hook(module, inputs, output):
        calls.append(1)
        return change(output) if len(calls) > NAN_FROM_CALL else output
    return hook


def _poison_router_loss(name: str):
    def change(output):
        probs, indices, losses = output
        return probs, indices, dataclasses.replace(losses, **{name: losses.__dict__[name] * math.nan})
    return change


POISONS = {  # loss name -> (module type, which instance, how its output turns non-finite)
    "mtp 1 loss": (MultiTokenPredictionLayer, 0, lambda output: output * math.nan),
    "mtp 2 loss": (MultiTokenPredictionLayer, 1, lambda output: output * math.nan),
    "moe aux loss": (TopKRouter, 0, _poison_router_loss("aux_loss")),
    "moe z loss": (TopKRouter, 0, _poison_router_loss("z_loss")),
}


def _provider_poisoning(loss: str):
    kind, index, change = POISONS[loss]
    calls: list[int] = []

    def provider(config, pstate, plan, device):
        chunk = pretrain_gpt.model_provider(config, pstate, plan, device)
        modules = [module for module in chunk.modules() if isinstance(module, kind)]
        modules[index].register_forward_hook(_nan_after(calls, change))
        return chunk
    return provider


@pytest.mark.parametrize("loss", sorted(POISONS))
def test_a_non_finite_loss_of_any_kind_stops_the_run_named_with_nothing_after_it_saved(loss, tmp_path):
    save = tmp_path / "checkpoints"
    config = make_config({**MOE_MTP, "save": str(save), "save_interval": 1})
    with pytest.raises(TrainingDivergedError, match=f"iteration 3: {loss} is nan; the step was not applied"):
        pretrain(config, _provider_poisoning(loss), pretrain_gpt.forward_step)
    assert directory.latest_iteration(str(save)) == 2


@pytest.fixture
def judged(monkeypatch) -> list[list[str]]:
    """The names of the losses each judgement of an iteration's result saw, in order."""
    seen = []
    original = RerunStateMachine.should_rerun

    def recording(self, result, *args):
        seen.append(list(result.losses))
        return original(self, result, *args)
    monkeypatch.setattr(RerunStateMachine, "should_rerun", recording)
    return seen


def test_every_loss_of_the_model_is_judged_each_iteration(judged):
    history = pretrain(make_config({**MOE_MTP, "train_iters": 2}), pretrain_gpt.model_provider,
                       pretrain_gpt.forward_step)
    assert judged == [ALL_LOSSES, ALL_LOSSES]
    assert all(math.isfinite(h["mtp_loss"]) for h in history)


def test_an_auxiliary_loss_that_does_not_enter_the_backward_is_not_judged(judged):
    pretrain(make_config({**MOE_MTP, "train_iters": 1, "moe_z_loss_coeff": 0.0, "mtp_num_layers": None}),
             pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    assert judged == [["lm loss", "moe aux loss"]]


def _config(**flags):
    return make_config({**MOE_MTP, **flags})


@pytest.mark.parametrize("loss", ALL_LOSSES[1:])
def test_a_spike_in_any_loss_is_suspicious(loss, monkeypatch):
    monkeypatch.setattr(rerun_state_machine, "STATISTICS_SAMPLES", 2)
    machine = RerunStateMachine(_config(check_for_spiky_loss=True), rank=0, mode="disabled")
    others = {name: 1.0 for name in ALL_LOSSES[1:]}
    for _ in range(2):
        assert machine._suspicion(Result(2.0, 1.0, torch.zeros(2), others)) is None
    spiked = Result(2.0, 1.0, torch.zeros(2), {**others, loss: 50.0})
    assert machine._suspicion(spiked).startswith(f"{loss} 50 is at least 10 x the largest of the first 2")


def test_reruns_compare_every_loss():
    first = Result(2.0, 1.0, torch.zeros(2), {"mtp 1 loss": 3.0})
    assert first.same_as(Result(2.0, 1.0, torch.zeros(2), {"mtp 1 loss": 3.0}))
    assert not first.same_as(Result(2.0, 1.0, torch.zeros(2), {"mtp 1 loss": 3.5}))


@pytest.mark.parametrize("depths, seq_length", [(64, 64), (17, 16)])
def test_a_depth_without_a_target_in_a_sequence_is_refused_at_start_up(depths, seq_length):
    with pytest.raises(ConfigError, match=rf"--mtp-num-layers \({depths}\) leaves depth {seq_length} without a target"):
        make_config({**MOE_MTP, "mtp_num_layers": depths, "seq_length": seq_length,
                     "max_position_embeddings": seq_length})
    assert make_config({**MOE_MTP, "mtp_num_layers": 15}).model.mtp_num_layers == 15
