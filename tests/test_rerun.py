"""--rerun-mode: a suspicious iteration runs again on the same micro-batches from the same state; the same result
is the data's (recorded, training goes on as if nothing happened), another one is a fault of the machine (the
ranks named, the run stopped with Megatron's exit status 17)."""

import socket

import pytest
import torch

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.errors import TrainingDivergedError
from megatron_lite.training import rerun_state_machine
from megatron_lite.training.loop import pretrain
from megatron_lite.training.rerun_state_machine import TransientFaultError
from tests.harness import run_on_ranks

VALUES = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
          "num_attention_heads": 2, "vocab_size": 64, "seq_length": 16, "max_position_embeddings": 16,
          "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 6, "lr": 3e-3, "lr_warmup_iters": 1,
          "hidden_dropout": 0.1, "eval_interval": 1000, "log_interval": 1}
SPIKED_ITERATION = 5  # 1-based, as logged: its micro-batches are the 9th and 10th of a one-rank run


class Faults:
    """pretrain_gpt.forward_step, with a reproducible spike in the loss of chosen micro-batches (chosen by their
    tokens, so that a replayed micro-batch spikes again) or a fault injected into one call only."""

    def __init__(self, spiked: set[int] = frozenset(), spike: float = 1000.0, faulty_call: int | None = None,
                 fault=None):
        self.spiked, self.spike, self.faulty_call, self.fault = spiked, spike, faulty_call, fault
        self.seen: list[torch.Tensor] = []
        self.calls: list[int] = []  # which distinct micro-batch each call read

    def forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        index = next((i for i, tokens in enumerate(self.seen) if torch.equal(tokens, batch["tokens"])), None)
        if index is None:
            self.seen.append(batch["tokens"].clone())
            index = len(self.seen) - 1
        self.calls.append(index)
        output, loss_func = pretrain_gpt.forward_step(iter([batch]), model)  # output: per-token losses
        if index in self.spiked:
            output = output * self.spike
        if len(self.calls) - 1 == self.faulty_call:
            output = self.fault(output, model)
        return output, loss_func


def spiked_microbatches(iteration: int, per_iteration: int = 2) -> set[int]:
    return set(range((iteration - 1) * per_iteration, iteration * per_iteration))


@pytest.fixture
def quick_statistics(monkeypatch):
    """Judge from the third value on (Megatron's first 100 values would need 100 iterations)."""
    monkeypatch.setattr(rerun_state_machine, "STATISTICS_SAMPLES", 2)


def _train(faults: Faults, **flags) -> list[dict]:
    config = make_config({**VALUES, **flags})
    return pretrain(config, pretrain_gpt.model_provider, faults.forward_step)


def _tracker_lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_reproducible_spike_is_recorded_and_trains_exactly_as_a_run_without_the_check(quick_statistics, tmp_path):
    tracker = tmp_path / "rejected.txt"
    checked = Faults(spiked_microbatches(SPIKED_ITERATION))
    history = _train(checked, check_for_spiky_loss=True, check_for_large_grads=True,
                     result_rejected_tracker_filename=str(tracker))
    unchecked = Faults(spiked_microbatches(SPIKED_ITERATION))
    reference = _train(unchecked)
    # the spiked iteration ran twice on the same two micro-batches, and only it
    assert checked.calls == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 8, 9, 10, 11]
    assert unchecked.calls == list(range(12))
    # the rerun restored everything the first run drew from (dropout masks included): the same run, to the bit
    assert [(h["lm_loss"], h["grad_norm"]) for h in history] == [(h["lm_loss"], h["grad_norm"]) for h in reference]
    assert history[SPIKED_ITERATION - 1]["lm_loss"] > 10 * max(h["lm_loss"] for h in history[:2])
    lines = _tracker_lines(tracker)
    assert [line.split(" status=")[1].split()[0] for line in lines] == ["initial_run", "first_rerun_reproducible"]
    assert all(f"iteration={SPIKED_ITERATION} " in line and f"node={socket.gethostname()} " in line for line in lines)
    assert all("message='lm loss" in line and "rank=0 " in line for line in lines)


def test_without_the_checks_nothing_is_rerun(quick_statistics):
    faults = Faults(spiked_microbatches(SPIKED_ITERATION))
    _train(faults)
    assert faults.calls == list(range(12))


def test_rerun_mode_disabled_records_and_warns_without_rerunning(quick_statistics, tmp_path, capsys):
    tracker = tmp_path / "rejected.txt"
    faults = Faults(spiked_microbatches(SPIKED_ITERATION))
    _train(faults, rerun_mode="disabled", check_for_spiky_loss=True, result_rejected_tracker_filename=str(tracker))
    assert faults.calls == list(range(12))
    assert [line.split(" status=")[1].split()[0] for line in _tracker_lines(tracker)] == ["rerun_disabled"]
    assert f"warning: iteration {SPIKED_ITERATION}: lm loss" in capsys.readouterr().out


def test_report_stats_runs_every_iteration_twice_and_reports_no_difference_on_a_cpu():
    faults = Faults()
    history = _train(faults, rerun_mode="report_stats", train_iters=3)
    assert faults.calls == [0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
    assert [h["rerun_max_relative_difference"] for h in history] == [0.0, 0.0, 0.0]
    reference = _train(Faults(), train_iters=3)
    assert [h["lm_loss"] for h in history] == [h["lm_loss"] for h in reference]


def test_a_nan_seen_once_is_a_transient_fault_and_a_reproducible_one_a_diverged_run(tmp_path):
    once = Faults(faulty_call=8, fault=lambda output, model: output * float("nan"))
    with pytest.raises(TransientFaultError, match=rf"iteration 5: lm loss is nan; rerun on the same data it gave "
                                                  rf"lm loss [0-9.]+.*\(rank 0 on {socket.gethostname()}\)"):
        _train(once)
    always = Faults(spiked_microbatches(SPIKED_ITERATION), spike=float("nan"))
    with pytest.raises(TrainingDivergedError, match="iteration 5: lm loss is nan; the step was not applied"):
        _train(always)
    assert always.calls == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 8, 9]  # judged only after its rerun


def _gradient_fault_on_rank_1(tracker: str) -> tuple[str, list[int]]:
    """DP2: rank 1's gradient of its first micro-batch of iteration 5 multiplied by 1e4, once; the error each
    rank raises and the micro-batches it read."""
    rerun_state_machine.STATISTICS_SAMPLES = 2
    rank = torch.distributed.get_rank()

    def multiply_one_gradient(output, model):
        weight = next(model.parameters())
        handle = None

        def hook(grad):
            handle.remove()
            return grad * 1e4
        handle = weight.register_hook(hook)
        return output

    faults = Faults(faulty_call=8 if rank == 1 else None, fault=multiply_one_gradient)
    config = make_config({**VALUES, "global_batch_size": 8, "check_for_large_grads": True,
                          "result_rejected_tracker_filename": tracker}, 2)
    try:
        pretrain(config, pretrain_gpt.model_provider, faults.forward_step)
    except TransientFaultError as error:
        return str(error), faults.calls
    finally:
        rerun_state_machine.STATISTICS_SAMPLES = 100
    return "no error", faults.calls


def test_a_fault_in_one_ranks_gradient_names_that_rank_and_stops_the_run(tmp_path):
    tracker = tmp_path / "rejected.txt"
    results = run_on_ranks(2, _gradient_fault_on_rank_1, str(tracker))
    host = socket.gethostname()
    for message, calls in results:
        assert "iteration 5: grad norm" in message and f"rank 1 on {host}" in message, message
        assert "rank 0 on" not in message and "the step was not applied" in message, message
        assert calls == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 8, 9], calls  # stopped after the rerun of iteration 5
    statuses = [(line.split(" status=")[1].split()[0], line.split(" rank=")[1].split()[0])
                for line in _tracker_lines(tracker)]
    assert statuses == [("initial_run", "0"), ("first_rerun_not_reproducible", "1")]


def test_a_transient_fault_exits_with_megatrons_status_17(monkeypatch):
    def fault(*args):
        raise TransientFaultError("iteration 5: a transient fault")

    monkeypatch.setattr("megatron_lite.training.loop.pretrain", fault)
    assert pretrain_gpt.main(["--model-preset", "llama-tiny", "--mock-data", "--train-iters", "2"]) == 17
