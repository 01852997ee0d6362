"""Pipeline parallelism trains exactly as one process: 1F1B and interleaved, with TP, SP, DP, tied embeddings
and uneven splits. Losses of 4 steps, final weights and the last step's gradients equal the single-device
run's; every rank reports the loss.
"""

from __future__ import annotations

from tests.harness import run_on_ranks
from tests.helpers import TINY_8_LAYERS, assert_run_matches, join_shards, reference, train_and_collect

GPT2_LIKE = {
    **TINY_8_LAYERS, "model_preset": "gpt2-124m", "num_layers": 4, "num_attention_heads": 4, "ffn_hidden_size": 256,
    "vocab_size": 500, "hidden_dropout": 0.0, "attention_dropout": 0.0, "num_query_groups": None,
}

def test_pp2_1f1b_matches_single_device():
    values = {**TINY_8_LAYERS, "pipeline_model_parallel_size": 2}
    assert_run_matches(run_on_ranks(2, train_and_collect, values, 2), reference(TINY_8_LAYERS))


def test_pp2_interleaved_vp2_matches_single_device():
    values = {**TINY_8_LAYERS, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2}
    assert_run_matches(run_on_ranks(2, train_and_collect, values, 2), reference(TINY_8_LAYERS))


def test_pp4_1f1b_matches_single_device():
    values = {**TINY_8_LAYERS, "pipeline_model_parallel_size": 4}
    assert_run_matches(run_on_ranks(4, train_and_collect, values, 4), reference(TINY_8_LAYERS))


def test_pp4_interleaved_vp2_matches_single_device():
    values = {**TINY_8_LAYERS, "pipeline_model_parallel_size": 4, "num_layers_per_virtual_pipeline_stage": 1}
    assert_run_matches(run_on_ranks(4, train_and_collect, values, 4), reference(TINY_8_LAYERS))


def test_pp2_interleaved_dp2_with_overlapped_grad_reduce_matches_single_device():
    values = {**TINY_8_LAYERS, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 2,
              "overlap_grad_reduce": True}
    assert_run_matches(run_on_ranks(4, train_and_collect, values, 4), reference(TINY_8_LAYERS))


def test_pp2_tp2_dp2_sequence_parallel_matches_single_device():
    """Against one process: losses to 1e-5; weights and gradients after the Adam steps to 1e-4, the rounding
    that tensor parallelism brings by itself (a few elements differ by ~2e-5 after 10 steps, with or without
    a pipeline). Against the same TP2 x SP x DP2 layout without a pipeline: equal to 1e-6, so the pipeline
    adds no error of its own."""
    tp2_dp2 = {**TINY_8_LAYERS, "tensor_model_parallel_size": 2, "sequence_parallel": True,
               "overlap_grad_reduce": True}
    pipelined = run_on_ranks(8, train_and_collect, {**tp2_dp2, "pipeline_model_parallel_size": 2}, 8)
    assert_run_matches(pipelined, reference(TINY_8_LAYERS), tensor_rel=1e-4)
    ranks = run_on_ranks(4, train_and_collect, tp2_dp2, 4)
    without_pipeline = (ranks[0][0], sum((r[1] for r in ranks), []), sum((r[2] for r in ranks), []))
    assert_run_matches(pipelined, without_pipeline, rel=1e-6, tensor_rel=1e-6)


def test_gpt2_tied_embeddings_over_pp2_match_single_device():
    """Both stages' copies of the tied embedding stay equal to the single-device table."""
    values = {**GPT2_LIKE, "pipeline_model_parallel_size": 2}
    results = run_on_ranks(2, train_and_collect, values, 2)
    assert_run_matches(results, reference(GPT2_LIKE))
    copies = [key for key in join_shards([r[1] for r in results]) if key[0] == "embedding.word_embeddings.weight"]
    assert sorted(replica[2] for _, replica in copies) == [0, 1]


def test_uneven_split_of_7_layers_over_pp2_matches_single_device():
    values = {**TINY_8_LAYERS, "num_layers": 7}
    results = run_on_ranks(2, train_and_collect, {**values, "pipeline_model_parallel_size": 2,
                                                   "decoder_first_pipeline_num_layers": 3}, 2)
    assert_run_matches(results, reference(values))
    layers_by_stage = {}
    for name, replica, *_ in results[0][1] + results[1][1]:
        if name.startswith("decoder.layers."):
            layers_by_stage.setdefault(replica[2], set()).add(int(name.split(".")[2]))
    assert layers_by_stage == {0: {0, 1, 2}, 1: {3, 4, 5, 6}}
