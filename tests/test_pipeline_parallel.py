"""Pipeline parallelism trains exactly as one process: 1F1B and interleaved, with TP, SP, DP, tied embeddings
and uneven splits. Losses of 10 steps, final weights and the last step's gradients equal the single-device
run's; every rank reports the loss. The helpers here (runs that return weights and gradients by global name,
TP shards joined for comparison) also serve test_pipeline_schedules.py.
"""

from __future__ import annotations

import pretrain_gpt
from megatron_lite.config import make_config
from megatron_lite.model.sharding import unshard
from megatron_lite.training import pretrain
from tests.harness import run_on_ranks
from tests.tolerances import assert_close_relative

TINY_8_LAYERS = {
    "model_preset": "llama-tiny", "mock_data": True, "num_layers": 8, "hidden_size": 64, "ffn_hidden_size": 128,
    "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 256, "seq_length": 32,
    "max_position_embeddings": 32, "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 10, "lr": 3e-3,
    "lr_warmup_iters": 1, "eval_interval": 1000, "log_interval": 1000,
}
GPT2_LIKE = {
    **TINY_8_LAYERS, "model_preset": "gpt2-124m", "num_layers": 4, "num_attention_heads": 4, "ffn_hidden_size": 256,
    "vocab_size": 500, "hidden_dropout": 0.0, "attention_dropout": 0.0,
}

_BUILT: list = []


def _capturing_provider(config, pstate, plan, device):
    """pretrain_gpt's model provider, keeping each chunk so the test can read its weights afterwards."""
    chunk = pretrain_gpt.model_provider(config, pstate, plan, device)
    _BUILT.append(chunk)
    return chunk


def parameter_records(chunks, tensor_of) -> list[tuple]:
    """(global name, replica, tp rank, spec, tensor) for every parameter of this rank's model chunks.

    A replica is the (dp, cp, pp) position holding a copy: data-parallel replicas and the last stage's copy
    of tied embeddings are each compared with the reference on their own.
    """
    records = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        pstate = module.pstate
        replica = (pstate.dp_rank, pstate.cp_rank, pstate.pp_rank)
        for name, param in module.named_global_parameters():
            records.append((name, replica, pstate.tp_rank, param.spec, tensor_of(param).detach().clone()))
    return records


def train_and_collect(values: dict, world_size: int):
    """Train with training.pretrain; per-step losses, final weights and the last step's gradients."""
    _BUILT.clear()
    history = pretrain(make_config(values, world_size), _capturing_provider, pretrain_gpt.forward_step)
    return ([h["lm_loss"] for h in history], parameter_records(_BUILT, lambda p: p),
            parameter_records(_BUILT, lambda p: p.main_grad))


def join_shards(records_of_all_ranks: list[list[tuple]]) -> dict[tuple, object]:
    """{(name, replica): global tensor} from every rank's records, TP shards joined in TP-rank order."""
    pieces: dict[tuple, dict] = {}
    for records in records_of_all_ranks:
        for name, replica, tp_rank, spec, tensor in records:
            pieces.setdefault((name, replica), {})[tp_rank] = (spec, tensor)
    joined = {}
    for key, by_rank in pieces.items():
        spec = by_rank[0][0]
        joined[key] = unshard([by_rank[r][1] for r in sorted(by_rank)], spec)
    return joined


def assert_tensors_match(parallel: dict[tuple, object], reference: dict[tuple, object], rel: float = 1e-5,
                         floor: float = 0.0):
    """Every parallel copy of every parameter equals the single-device tensor element by element, to `rel`
    of the tensor's largest element and at least an absolute `floor`; every reference parameter is present
    somewhere in the parallel run."""
    seen = set()
    for (name, _replica), tensor in parallel.items():
        assert_close_relative(tensor, reference[(name, (0, 0, 0))], rel=rel, msg=name, floor=floor)
        seen.add(name)
    assert seen == {name for name, _ in reference}


def assert_run_matches(parallel_results: list, reference_result, rel: float = 1e-5, tensor_rel: float = 1e-5):
    """Losses of every rank (each reports the global loss) equal the reference at every step to `rel`;
    final weights and last-step gradients equal the reference ones to `tensor_rel`.

    Weights get an absolute floor of `tensor_rel` (they are O(0.01-1) numbers): a parameter whose gradient
    is zero in exact arithmetic, such as GPT-2's key bias (softmax ignores a shift shared by all keys), is
    moved by Adam on rounding noise alone, by ~1e-6 per step, differently in every layout."""
    ref_losses, ref_weights, ref_grads = reference_result
    for losses, _, _ in parallel_results:
        assert len(losses) == len(ref_losses)
        for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
            assert abs(loss - ref) <= rel * abs(ref), f"step {step}: loss {loss} vs {ref}"
    assert_tensors_match(join_shards([r[1] for r in parallel_results]), join_shards([ref_weights]), tensor_rel,
                         floor=tensor_rel)
    assert_tensors_match(join_shards([r[2] for r in parallel_results]), join_shards([ref_grads]), tensor_rel)


_REFERENCES: dict = {}


def reference(values: dict):
    """The single-device run of `values`, computed once per test session."""
    key = tuple(sorted(values.items()))
    if key not in _REFERENCES:
        _REFERENCES[key] = train_and_collect(values, 1)
    return _REFERENCES[key]


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
    """Against one process: losses to 1e-5; weights and gradients after 10 Adam steps to 1e-4, the rounding
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
