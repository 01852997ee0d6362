"""Start-up that grows with a rank's shard: under pipeline and expert parallelism a rank draws the initial values of
the parameters it holds and of no other (tensor parallelism: tests/test_initialization.py)."""

import pytest

from megatron_lite.model import sharding
from tests.harness import run_on_ranks
from tests.helpers import build_run

MOE = {"model_preset": "mixtral-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
       "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 60, "seq_length": 16,
       "max_position_embeddings": 16, "num_experts": 4, "moe_router_topk": 2, "micro_batch_size": 2,
       "global_batch_size": 4, "train_iters": 1}


def _drawn_and_held(values: dict, world_size: int) -> tuple[dict, dict]:
    """Elements drawn per global name while this rank builds its model, and the elements of each randomly
    initialised parameter it holds."""
    drawn = {}
    with sharding.recorded_draws() as draws:
        model = build_run(values, world_size)[3]
    for global_name, elements in draws:
        drawn[global_name] = drawn.get(global_name, 0) + elements
    held = {name: p.numel() for chunk in model for name, p in chunk.module.named_global_parameters()
            if p.spec.init in ("normal", "scaled_normal")}
    return drawn, held


@pytest.mark.parametrize("flags", [{"expert_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}],
                         ids=["ep2", "pp2"])
def test_each_rank_draws_only_the_parameters_it_holds(flags):
    (drawn0, held0), (drawn1, held1) = run_on_ranks(2, _drawn_and_held, {**MOE, **flags}, 2)
    single, _ = _drawn_and_held(MOE, 1)
    assert drawn0 == held0 and drawn1 == held1
    assert {**drawn0, **drawn1} == single  # together the single device's parameters, each whole (no TP)
    experts = {name for name in single if ".mlp.experts." in name}
    on_both = set(drawn0) & set(drawn1)
    if "expert_model_parallel_size" in flags:  # DP2 replicas of the dense parameters, experts split in two
        assert on_both == set(single) - experts and len(experts & set(drawn0)) == len(experts) // 2
    else:  # each stage its own layer; the untied embedding on the first stage, the output layer on the last
        assert on_both == set()
