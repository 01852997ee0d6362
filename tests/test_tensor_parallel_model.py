"""Whole models under tensor (and sequence) parallelism equal the single-device model.

GPT-2-like (LayerNorm, GELU, learned positions, biases, tied embeddings) and Llama-like (RMSNorm,
SwiGLU, RoPE, GQA, untied) models at TP 2 and 4, with and without sequence parallelism, on a 4-rank
world (the remaining ranks are data-parallel replicas that each take their share of the batch): the
logits, the initial weights and every parameter's gradient after finalize_model_grads, gathered over
TP, equal the single-device model's. Then 10 training steps of TP2 x DP2 equal one process.
"""

import pytest
import torch

import pretrain_gpt
from megatron_lite.config import make_config
from megatron_lite.model.gpt import gather_vocab_logits
from megatron_lite.model.sharding import unshard
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.optim.grad_buffer import DistributedDataParallel
from megatron_lite.parallel.state import Layout, ParallelState
from megatron_lite.training import model_chunk_plans, pretrain
from tests.harness import run_on_ranks
from tests.test_tensor_parallel_layers import gather_pieces
from tests.tolerances import assert_close_relative

VOCAB, BATCH = 100, 4  # vocabulary padded to 104 / 112 / 128 rows at TP 1 / 2 / 4
SMALL = {"num_layers": 2, "hidden_size": 64, "seq_length": 32, "max_position_embeddings": 32, "vocab_size": VOCAB,
         "make_vocab_size_divisible_by": 8, "mock_data": True, "hidden_dropout": 0.0, "attention_dropout": 0.0}
MODELS = {
    "gpt2": {**SMALL, "model_preset": "gpt2-124m", "num_attention_heads": 4, "ffn_hidden_size": 128},
    "llama_gqa": {**SMALL, "model_preset": "llama-tiny", "num_attention_heads": 8, "num_query_groups": 4,
                  "ffn_hidden_size": 96},
}
LAYOUTS = [(tp, sp) for tp in (2, 4) for sp in (False, True)]


def batch() -> torch.Tensor:
    """[BATCH, seq + 1] tokens, the same in every process."""
    return torch.randint(0, VOCAB, (BATCH, SMALL["seq_length"] + 1), generator=torch.Generator().manual_seed(0))


def forward_backward(values: dict, pstate: ParallelState, world_size: int) -> dict:
    """This data-parallel rank's logits; the gathered initial weights and global-batch-mean gradients."""
    config = make_config(values, world_size)
    plan = model_chunk_plans(config, pstate.pp_rank)[0]
    model = DistributedDataParallel(pretrain_gpt.model_provider(config, pstate, plan, torch.device("cpu")), pstate)
    rows = BATCH // pstate.dp_size
    tokens = batch()[pstate.dp_rank * rows:(pstate.dp_rank + 1) * rows]
    inputs, labels, positions = tokens[:, :-1], tokens[:, 1:], torch.arange(SMALL["seq_length"])
    model(inputs, positions, labels=labels).sum().backward()  # per-token losses [b, s]
    finalize_model_grads([model], pstate, torch.tensor(float(labels.numel())))
    with torch.no_grad():
        logits = gather_vocab_logits(model(inputs, positions), pstate, VOCAB)  # [b, s, vocab]
    result = {"logits": logits, "weights": {}, "grads": {}, "padded_grads": {}}
    tp_group = pstate.group("tp")
    for name, param in model.module.named_global_parameters():
        weight = unshard(gather_pieces(param, tp_group), param.spec)
        grad = unshard(gather_pieces(param.main_grad, tp_group), param.spec)
        valid = param.spec.valid_rows
        result["weights"][name] = weight[:valid]
        result["grads"][name] = grad[:valid]
        if valid is not None:
            result["padded_grads"][name] = grad[valid:]
    return result


def run_model_cases():
    """Every model at every layout; results from TP rank 0 of each data-parallel rank."""
    results = {}
    for tp, sp in LAYOUTS:
        pstate = ParallelState.build(Layout.from_world(4, tp=tp))
        for name, values in MODELS.items():
            values = {**values, "tensor_model_parallel_size": tp, "sequence_parallel": sp}
            result = forward_backward(values, pstate, 4)
            if pstate.tp_rank == 0:  # the other TP ranks gathered the same tensors
                results[(name, tp, sp)] = (pstate.dp_rank, pstate.dp_size, result)
    return results


@pytest.fixture(scope="module")
def model_results():
    return run_on_ranks(4, run_model_cases)


@pytest.fixture(scope="module")
def references():
    return {name: forward_backward(values, ParallelState.single(), 1) for name, values in MODELS.items()}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("tp", "sequence_parallel"), LAYOUTS)
def test_tp_model_matches_single_device(model_results, references, name, tp, sequence_parallel):
    reference = references[name]
    checked_rows = 0
    for rank_results in model_results:
        if (name, tp, sequence_parallel) not in rank_results:
            continue
        dp_rank, dp_size, got = rank_results[(name, tp, sequence_parallel)]
        rows = BATCH // dp_size
        assert_close_relative(got["logits"], reference["logits"][dp_rank * rows:(dp_rank + 1) * rows], rel=1e-5)
        checked_rows += rows
        assert got["weights"].keys() == reference["grads"].keys()
        for param_name, weight in reference["weights"].items():
            assert torch.equal(got["weights"][param_name], weight), param_name
        for param_name, grad in reference["grads"].items():
            scale = grad.abs().max().item()
            assert_close_relative(got["grads"][param_name], grad, rel=1e-5, msg=param_name)
            assert scale > 0, param_name
        for param_name, padded in got["padded_grads"].items():
            assert padded.numel() > 0 and torch.count_nonzero(padded) == 0, param_name
    assert checked_rows == BATCH


# ---------------------------------------------------------------------------------------------------
# Training: TP2 x DP2 for 10 steps equals one process

TRAIN = {"micro_batch_size": 2, "global_batch_size": 8, "train_iters": 10, "lr": 3e-3, "lr_warmup_iters": 2,
         "eval_interval": 1000, "log_interval": 1000}


def train(values: dict, world_size: int):
    config = make_config(values, world_size)
    return [(h["lm_loss"], h["grad_norm"]) for h in pretrain(config, pretrain_gpt.model_provider,
                                                             pretrain_gpt.forward_step)]


@pytest.mark.parametrize(("name", "sequence_parallel"), [("gpt2", True), ("llama_gqa", False)])
def test_tp2_dp2_training_matches_single_process(name, sequence_parallel):
    values = {**MODELS[name], **TRAIN}
    reference = train(values, 1)
    parallel = run_on_ranks(4, train, {**values, "tensor_model_parallel_size": 2,
                                       "sequence_parallel": sequence_parallel}, 4)
    assert len(reference) == 10
    for rank_history in parallel:
        for (loss, norm), (ref_loss, ref_norm) in zip(rank_history, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert reference[-1][0] < reference[0][0]
