"""A checkpoint saved in one layout resumes in any other: the following losses equal the uninterrupted run."""

import functools

import pytest

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# SwiGLU (fc1 is two boxes per TP rank), a vocabulary padded differently at TP1 (384 rows) and TP2 (512),
# embeddings tied across the first and last pipeline stage, and 4 layers for up to 4 stages.
MODEL = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128,
         "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 300, "seq_length": 32,
         "max_position_embeddings": 32, "untie_embeddings_and_output_weights": False, "micro_batch_size": 1,
         "global_batch_size": 8, "train_iters": 10, "lr": 3e-3, "lr_warmup_iters": 2, "eval_interval": 1000,
         "log_interval": 1000}
TP2_PP2_DP2 = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "use_distributed_optimizer": True}
TP1_PP4_DP2 = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4, "use_distributed_optimizer": True}


def train(values: dict, world_size: int) -> list[float]:
    config = make_config({**MODEL, **values}, world_size)
    return [h["lm_loss"] for h in pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)]


@functools.cache
def uninterrupted() -> list[float]:
    """The uninterrupted run on one rank, computed once for all tests here."""
    return train({}, 1)


def first_half(layout: dict, root: str, world_size: int) -> list[float]:
    return train({**layout, "save": root, "exit_interval": 5}, world_size)


def second_half(layout: dict, root: str, world_size: int) -> list[float]:
    return train({**layout, "load": root}, world_size)


def _on_eight_ranks(root: str, single_rank_checkpoint: str) -> dict:
    """Every save and resume that needs 8 ranks, in one world (losses are those of the last stage)."""
    return {
        "tp2pp2dp2": first_half(TP2_PP2_DP2, f"{root}/tp2pp2dp2", 8),
        "tp2pp2dp2 -> tp1pp4dp2": second_half(TP1_PP4_DP2, f"{root}/tp2pp2dp2", 8),
        "tp1pp4dp2": first_half(TP1_PP4_DP2, f"{root}/tp1pp4dp2", 8),
        "tp1pp4dp2 -> tp2pp2dp2": second_half(TP2_PP2_DP2, f"{root}/tp1pp4dp2", 8),
        "tp1 -> tp2pp2dp2": second_half(TP2_PP2_DP2, single_rank_checkpoint, 8),
    }


def test_reshard_between_tp2_pp2_dp2_tp1_pp4_dp2_and_one_rank_with_distributed_optimizer(tmp_path):
    reference = uninterrupted()
    single = first_half({}, f"{tmp_path}/tp1", 1)
    assert single == reference[:5]
    runs = run_on_ranks(8, _on_eight_ranks, str(tmp_path), f"{tmp_path}/tp1")[-1]
    runs["tp2pp2dp2 -> tp1"] = second_half({}, f"{tmp_path}/tp2pp2dp2", 1)
    for name in ("tp2pp2dp2", "tp1pp4dp2"):
        assert runs[name] == pytest.approx(reference[:5], rel=1e-5), name
    for name in ("tp2pp2dp2 -> tp1pp4dp2", "tp1pp4dp2 -> tp2pp2dp2", "tp1 -> tp2pp2dp2", "tp2pp2dp2 -> tp1"):
        assert len(runs[name]) == 5
        assert runs[name] == pytest.approx(reference[5:], rel=1e-5), name


def _zero3_first_half(root: str) -> list[float]:
    return first_half({"data_parallel_sharding_strategy": "optim_grads_params"}, root, 2)


def test_zero3_dp2_checkpoint_resumes_on_one_rank(tmp_path):
    """Under ZeRO-3 the weights exist only as data-parallel shards; the checkpoint still holds whole tensors."""
    reference = uninterrupted()
    first = run_on_ranks(2, _zero3_first_half, str(tmp_path))[-1]
    assert first == pytest.approx(reference[:5], rel=1e-5)
    assert second_half({}, str(tmp_path), 1) == pytest.approx(reference[5:], rel=1e-5)


def _interleaved_and_context_parallel_first_halves(root: str) -> dict:
    return {"vp": first_half({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1},
                             f"{root}/vp", 2),
            "cp": first_half({"context_parallel_size": 2}, f"{root}/cp", 2)}


def test_interleaved_pipeline_and_context_parallel_checkpoints_resume_on_one_rank(tmp_path):
    reference = uninterrupted()
    firsts = run_on_ranks(2, _interleaved_and_context_parallel_first_halves, str(tmp_path))[-1]
    for name in ("vp", "cp"):
        assert firsts[name] == pytest.approx(reference[:5], rel=1e-5), name
        assert second_half({}, f"{tmp_path}/{name}", 1) == pytest.approx(reference[5:], rel=1e-5), name
