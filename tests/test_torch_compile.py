"""--torch-compile trains as eager mode does: compiled transformer layers give eager's losses to float rounding.

Each case trains a tiny model for a few steps through pretrain(), evaluates once, and compares every logged
loss and gradient norm with the same run in eager mode (fp32, relative 1e-5). Inductor compiles on the CPU
(a cold compile costs tens of seconds), so the cases are few and cover the paths that differ under
compilation: dropout (hidden dropout inside the graph; attention dropout and sequence-parallel dropout on
the tensor-parallel random stream, eager at a graph break), full and selective recomputation, an MoE layer
(eager inside a compiled layer), tensor + sequence parallelism (collectives inside the graph) and
interleaved pipeline chunks.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.utils import counters

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.data.mock import MockGPTDataset
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks

TINY = {
    "mock_data": True, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
    "vocab_size": 256, "seq_length": 32, "max_position_embeddings": 32, "micro_batch_size": 1,
    "global_batch_size": 4, "train_iters": 3, "lr": 3e-3, "eval_interval": 3, "eval_iters": 1,
}
GPT2 = {**TINY, "model_preset": "gpt2-124m", "hidden_dropout": 0.1, "attention_dropout": 0.1}
LLAMA = {**TINY, "model_preset": "llama-tiny", "num_query_groups": 2}


def train(values: dict, world_size: int) -> None:
    pretrain(make_config(values, world_size), pretrain_gpt.model_provider, pretrain_gpt.forward_step)


def logged_figures(path) -> list[tuple[int, str, float]]:
    """(iteration, name, value) of every loss and gradient norm in a metrics JSONL."""
    figures = []
    with open(path) as f:
        for record in map(json.loads, f):
            figures += [(record["iteration"], name, record[name])
                        for name in ("lm_loss", "grad_norm", "valid_lm_loss") if name in record]
    return figures


def assert_compiled_trains_as_eager(values: dict, tmp_path, world_size: int = 1) -> None:
    runs = {}
    for compiled in (False, True):
        path = tmp_path / f"torch_compile_{compiled}.jsonl"
        run_values = {**values, "torch_compile": compiled, "metrics_jsonl": str(path)}
        if world_size == 1:
            train(run_values, 1)
        else:
            run_on_ranks(world_size, train, run_values, world_size)
        runs[compiled] = logged_figures(path)
    eager, compiled = runs[False], runs[True]
    assert [(i, name) for i, name, _ in compiled] == [(i, name) for i, name, _ in eager]
    assert len(eager) == 2 * values["train_iters"] + 1  # loss and norm per step, one validation loss
    for (iteration, name, value), (_, _, reference) in zip(compiled, eager):
        assert value == pytest.approx(reference, rel=1e-5), f"iteration {iteration} {name}"


@pytest.mark.slow
def test_compiled_gpt2_with_dropout_and_full_recompute_trains_as_eager_with_one_graph_for_all_layers(tmp_path):
    """Three layers and full recomputation, yet dynamo compiles one graph for training and one for evaluation:
    the layers share them, and recomputation re-runs the compiled layer."""
    torch._dynamo.reset()  # compile afresh, so that the counters see every graph
    counters.clear()
    values = {**GPT2, "num_layers": 3, "attention_dropout": 0.0, "recompute_granularity": "full"}
    assert_compiled_trains_as_eager(values, tmp_path)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]


@pytest.mark.slow
def test_compiled_llama_with_moe_layer_dropout_and_selective_recompute_trains_as_eager(tmp_path):
    values = {**LLAMA, "num_experts": 4, "moe_layer_freq": 2, "moe_aux_loss_coeff": 0.01,
              "hidden_dropout": 0.1, "attention_dropout": 0.1, "recompute_granularity": "selective"}
    assert_compiled_trains_as_eager(values, tmp_path)


@pytest.mark.slow
def test_compiled_tp2_sequence_parallel_with_dropout_and_full_recompute_trains_as_eager(tmp_path):
    values = {**GPT2, "tensor_model_parallel_size": 2, "sequence_parallel": True, "recompute_granularity": "full"}
    assert_compiled_trains_as_eager(values, tmp_path, world_size=2)


@pytest.mark.slow
def test_compiled_pp2_interleaved_chunks_train_as_eager(tmp_path):
    values = {**LLAMA, "num_layers": 4, "pipeline_model_parallel_size": 2,
              "num_layers_per_virtual_pipeline_stage": 1}
    assert_compiled_trains_as_eager(values, tmp_path, world_size=2)


def _graphs_compiled(values: dict, world_size: int) -> int:
    torch._dynamo.reset()
    counters.clear()
    train(values, world_size)
    return counters["stats"]["unique_graphs"]


def _graphs_of_one_and_of_eight_micro_batches(values: dict) -> tuple[int, int]:
    return (_graphs_compiled({**values, "global_batch_size": 1, "train_iters": 1}, 2),
            _graphs_compiled({**values, "global_batch_size": 4, "train_iters": 2}, 2))


@pytest.mark.slow
def test_compiled_context_parallel_documents_compile_once_for_every_micro_batch():
    """CP2 with --reset-attention-mask: the context-parallel attention plans its blocks on the host from each
    micro-batch's documents, which dynamo would trace and guard on (a recompile for nearly every micro-batch).
    It runs eagerly, so eight micro-batches with different document counts compile what one does."""
    values = {**LLAMA, "num_layers": 1, "seq_length": 64, "max_position_embeddings": 64, "vocab_size": 64,
              "eval_iters": 0, "context_parallel_size": 2, "reset_attention_mask": True, "torch_compile": True}
    samples = MockGPTDataset(8, values["seq_length"], values["vocab_size"], make_config(values, 2).training.seed)
    assert len({int((samples[i][:-1] == samples.eod).sum()) for i in range(8)}) > 1  # documents differ
    one, eight = run_on_ranks(2, _graphs_of_one_and_of_eight_micro_batches, values)[0]
    assert eight == one, (one, eight)
