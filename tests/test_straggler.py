"""--log-straggler: a rank made slow is named as the slowest, with the phase it is slow in, in every sink."""

import json
import socket
import statistics
import time

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.errors import ConfigError
from megatron_lite.training.loop import pretrain
from megatron_lite.training.straggler import straggler_summary
from megatron_lite.training.timers import PHASES
from tests.harness import run_on_ranks

VALUES = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
          "num_attention_heads": 2, "vocab_size": 64, "seq_length": 16, "max_position_embeddings": 16,
          "micro_batch_size": 1, "global_batch_size": 4, "train_iters": 4, "log_interval": 2, "eval_interval": 1000,
          "log_straggler": True}
DELAY_S = 0.05  # per micro-batch on the slow rank: 2 micro-batches a rank per iteration, 2 iterations an interval


def test_the_summary_takes_min_median_max_per_phase_and_ranks_by_own_work():
    # rank 2 waits longest in the gradient reduction (waiting is not slowness); rank 1 is slow in its data
    times = [[10.0, 5.0, 2.0, 1.0], [11.0, 4.0, 2.0, 30.0], [9.0, 40.0, 2.0, 1.0], [12.0, 6.0, 3.0, 1.0]]
    hosts = ["a", "a", "b", "b"]
    summary = straggler_summary(times, hosts, count=2)
    for k, phase in enumerate(PHASES):
        column = [row[k] for row in times]
        assert summary[f"straggler_{phase}_ms_min"] == min(column)
        assert summary[f"straggler_{phase}_ms_median"] == statistics.median(column)
        assert summary[f"straggler_{phase}_ms_max"] == max(column)
        assert summary[f"straggler_{phase}_max_rank"] == column.index(max(column))
    assert summary["straggler_slowest_rank"] == 1
    assert summary["stragglers"] == [
        {"rank": 1, "host": "a", "phase": "data_wait", "ms": 30.0, "median_ms": 1.0},
        {"rank": 3, "host": "b", "phase": "forward_backward", "ms": 12.0, "median_ms": 10.5}]


def _train_with_a_slow_rank(slow_rank: int, metrics: str) -> list[dict]:
    import torch.distributed as dist

    def forward_step(data_iterator, model):
        if dist.get_rank() == slow_rank:
            time.sleep(DELAY_S)
        return pretrain_gpt.forward_step(data_iterator, model)

    config = make_config({**VALUES, "metrics_jsonl": metrics}, world_size=2)
    return pretrain(config, pretrain_gpt.model_provider, forward_step)


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_a_rank_made_slow_is_named_with_its_phase_at_dp2(slow_rank, tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    histories = run_on_ranks(2, _train_with_a_slow_rank, slow_rank, metrics)
    logged = [record for record in histories[1] if "stragglers" in record]
    assert [record["iteration"] for record in logged] == [2, 4]
    assert not any("stragglers" in record for record in histories[0])  # only the logging rank reports
    for record in logged:
        (straggler,) = record["stragglers"]
        assert (straggler["rank"], straggler["phase"], straggler["host"]) == (slow_rank, "forward_backward",
                                                                              socket.gethostname())
        assert record["straggler_slowest_rank"] == slow_rank
        assert record["straggler_forward_backward_max_rank"] == slow_rank
        # the slow rank's own forward-backward time holds its sleeps (time.sleep waits at least DELAY_S); a bound on
        # the spread to the other rank would also hold that rank's compute time, which a loaded machine stretches
        assert record["straggler_forward_backward_ms_max"] >= 1e3 * DELAY_S * 2 * 2
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["straggler_slowest_rank"] for r in written if "stragglers" in r] == [slow_rank, slow_rank]


def test_the_console_line_names_the_slowest_rank(capsys):
    history = pretrain(make_config(VALUES), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    assert [record["straggler_slowest_rank"] for record in history if "stragglers" in record] == [0, 0]
    lines = [line for line in capsys.readouterr().out.splitlines() if " iteration " in line]
    assert sum(f"slowest rank 0 ({socket.gethostname()})" in line for line in lines) == 2


def test_straggler_flags_need_log_straggler_and_a_positive_count():
    with pytest.raises(ConfigError, match="--straggler-minmax-count acts only with --log-straggler"):
        make_config({**VALUES, "log_straggler": False, "straggler_minmax_count": 2})
    with pytest.raises(ConfigError, match="straggler_minmax_count|straggler-minmax-count"):
        make_config({**VALUES, "straggler_minmax_count": 0})
