"""Context parallelism: CP 2 and 4, every --cp-comm-type, equal the single-device model.

One call on a 4-rank world runs every model case (CP2 x DP2 and CP4, each comm type, Llama with GQA and
RoPE and GPT-2 with learned positions) and returns each rank's logits and per-token losses for its
positions and the gradients summed over the cp group; the pytest process puts the sequence back together
and compares with the single-device model built from the same seed. Ring attention alone (CP4, torch's CPU
flash kernel) equals causal SDPA on the whole sequence and creates no tensor the size of a block of scores.
Training runs CP2 with TP2 + SP, DP2 (all-gather, full recomputation) and PP2, and CP4 a2a+p2p as 2 x 2, for 10
steps against one process.
"""

import functools
import io
from contextlib import redirect_stderr

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.model.attention.context_parallel import (
    CpuFlashKernel,
    RingAttention,
    _merge,
    get_batch_on_this_cp_rank,
    load_balanced_indices,
)
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import Layout, ParallelState
from megatron_lite.training.loop import pretrain
from tests.harness import run_on_ranks
from tests.helpers import EQUIVALENCE_ITERS
from tests.tolerances import assert_close_relative

LLAMA = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 128, "seq_length": 256,
         "max_position_embeddings": 256, "vocab_size": 500}
GPT2 = {**LLAMA, "model_preset": "gpt2-124m", "num_query_groups": None, "hidden_dropout": 0.0,
        "attention_dropout": 0.0}
VALUES = {"llama": LLAMA, "gpt2": GPT2}
BATCH, PADDED_VOCAB, SEED = 2, 512, 7
MODEL_CASES = [("llama", 2, "p2p"), ("llama", 2, "allgather"), ("llama", 4, "p2p"), ("llama", 4, "allgather"),
               ("gpt2", 2, "p2p"), ("llama", 2, "a2a"), ("llama", 4, "a2a"),
               ("gpt2", 2, "a2a"), ("llama", 4, "a2a+p2p")]  # (model, cp, --cp-comm-type); a2a+p2p: A 2 x B cp/2


def make_batch(seq_length: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, LLAMA["vocab_size"], (BATCH, seq_length + 1), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(BATCH, seq_length)
    mask[1, -9:] = 0  # some padding, on the last rank-pair's chunk
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
            "position_ids": torch.arange(seq_length)}


def saved_activation_bytes(model, fn):
    """Run fn(); bytes of the tensors autograd saved for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return out, sum(storages.values())


def run_model(model: GPTModel, batch: dict) -> dict:
    """Logits, per-token losses, gradients of the masked loss sum, activation bytes saved for backward."""
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"])
    loss, saved = saved_activation_bytes(model, lambda: model(batch["tokens"], batch["position_ids"], batch["labels"]))
    (loss * batch["loss_mask"]).sum().backward()
    grads = {name: p.grad for name, p in model.named_global_parameters()}
    return {"logits": logits, "loss": loss.detach(), "grads": grads, "saved_bytes": saved}


def build(name: str, pstate: ParallelState, comm_type: str = "p2p") -> GPTModel:
    return GPTModel(make_config(VALUES[name]).model, pstate, padded_vocab=PADDED_VOCAB, seed=SEED,
                    cp_comm_type=comm_type)


# ---------------------------------------------------------------------------------------------------
# Worker side


def cp_model_cases(cases):
    results = []
    for name, cp, comm_type in cases:
        hierarchical_cp = (2, cp // 2) if comm_type == "a2a+p2p" else None
        pstate = ParallelState.build(Layout(cp=cp, dp=4 // cp, hierarchical_cp=hierarchical_cp))
        batch = get_batch_on_this_cp_rank(make_batch(VALUES[name]["seq_length"]), pstate)
        result = run_model(build(name, pstate, comm_type), batch)
        for grad in result["grads"].values():
            mappings.all_reduce(grad, pstate.group("cp"))
        if pstate.cp_rank:
            result["grads"] = None  # every cp rank holds the same sums
        results.append({**result, "cp_rank": pstate.cp_rank, "dp_rank": pstate.dp_rank,
                        "positions": batch["position_ids"]})
    return results


@functools.lru_cache
def single_device(name: str) -> dict:
    return run_model(build(name, ParallelState.single()), make_batch(VALUES[name]["seq_length"]))


def test_cp2_and_cp4_both_comm_types_match_single_device():
    per_rank = run_on_ranks(4, cp_model_cases, MODEL_CASES)
    for index, (name, cp, comm_type) in enumerate(MODEL_CASES):
        reference = single_device(name)
        ranks = [results[index] for results in per_rank]
        for dp_rank in range(4 // cp):
            replica = sorted((r for r in ranks if r["dp_rank"] == dp_rank), key=lambda r: r["cp_rank"])
            assert [r["cp_rank"] for r in replica] == list(range(cp))
            seq_length = VALUES[name]["seq_length"]
            logits = torch.empty_like(reference["logits"])
            loss = torch.empty_like(reference["loss"])
            for r in replica:
                assert torch.equal(r["positions"], load_balanced_indices(seq_length, cp, r["cp_rank"]))
                logits[:, r["positions"]] = r["logits"]
                loss[:, r["positions"]] = r["loss"]
                # activations saved for backward fall with the local sequence (no [s, s], no gathered K/V)
                assert r["saved_bytes"] < 1.1 * reference["saved_bytes"] / cp, (name, cp, comm_type)
            case = f"{name} cp{cp} {comm_type}"
            assert_close_relative(logits, reference["logits"], rel=1e-5, msg=case)
            assert_close_relative(loss, reference["loss"], rel=1e-5, msg=case)
            grads = replica[0]["grads"]
            assert grads.keys() == reference["grads"].keys()
            for param, grad in reference["grads"].items():
                assert_close_relative(grads[param], grad, rel=1e-5, msg=f"{case} {param}")


# ---------------------------------------------------------------------------------------------------
# Block kernels and the merge, in the pytest process


def test_cpu_block_kernel_merged_by_lse_equals_causal_sdpa():
    """Causal attention assembled from three blocks (two causal diagonals, one unmasked rectangle) merged by
    log-sum-exp equals SDPA, forward and backward, with GQA."""
    b, s, nh, ng, d, half = 2, 48, 4, 2, 16, 24
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, generator=generator).requires_grad_() for n in (nh, ng, ng))
    reference = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
    dout = torch.randn(reference.shape, generator=generator)
    reference.backward(dout)
    blocks = [(slice(0, half), slice(0, half), True), (slice(half, s), slice(half, s), True),
              (slice(half, s), slice(0, half), False)]
    scale = d ** -0.5
    with torch.no_grad():
        out = torch.empty(q.shape)
        lse = torch.empty(b, nh, s)
        for rows, keys, causal in blocks:
            block_out, block_lse = CpuFlashKernel.forward(q[:, rows], k[:, keys], v[:, keys], causal, scale)
            if causal:
                out[:, rows], lse[..., rows] = block_out, block_lse
            else:
                _merge(out[:, rows], lse[..., rows], block_out, block_lse)
        assert_close_relative(out, reference, rel=1e-5)
        grads = [torch.zeros_like(t) for t in (q, k, v)]
        for rows, keys, causal in blocks:
            dq, dk, dv = CpuFlashKernel.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                                 lse[..., rows], causal, scale)
            grads[0][:, rows] += dq
            grads[1][:, keys] += dk
            grads[2][:, keys] += dv
    for grad, tensor in zip(grads, (q, k, v)):
        assert_close_relative(grad, tensor.grad, rel=1e-5)


def test_batch_split_is_load_balanced():
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([load_balanced_indices(16, 4, r) for r in range(4)]).tolist()) == list(range(16))

    class Rank1Of2:
        cp_size, cp_rank = 2, 1

    batch = make_batch(8)
    local = get_batch_on_this_cp_rank(batch, Rank1Of2)
    assert local["position_ids"].tolist() == [2, 3, 4, 5]
    for key in ("tokens", "labels", "loss_mask"):
        assert torch.equal(local[key], batch[key][:, 2:6])


# ---------------------------------------------------------------------------------------------------
# Ring attention alone, on 4 ranks

RING_SHAPE = (2, 256, 4, 2, 8)  # b, s, nh, ng, d: d small, so q/k/v blocks are smaller than score blocks


class OpRecorder(TorchDispatchMode):
    """Records every aten op that runs below autograd, with the most elements among its outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, max(sizes, default=0)))
        return out


def whole_sequence_attention_inputs() -> list[torch.Tensor]:
    """q, k, v [b, s, n, d] with grouped K/V heads, and an output gradient: the same on every rank."""
    b, s, nh, ng, d = RING_SHAPE
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(b, s, n, d, generator=generator) for n in (nh, ng, ng, nh)]


def ring_attention_on_rank() -> dict:
    *qkv, dout = whole_sequence_attention_inputs()
    index = load_balanced_indices(RING_SHAPE[1], dist.get_world_size(), dist.get_rank())
    q, k, v = (t[:, index].requires_grad_() for t in qkv)
    with OpRecorder() as recorder:
        out = RingAttention.apply(q, k, v, dist.group.WORLD, CpuFlashKernel)
        out.backward(dout[:, index])
    return {"index": index, "out": out.detach(), "grads": [q.grad, k.grad, v.grad], "calls": recorder.calls}


def test_ring_attention_on_cpu_equals_causal_sdpa_without_score_tensors():
    """CP4 ring attention's output and q/k/v gradients equal causal SDPA over the whole sequence, and no op it
    runs, forward or backward, is a matmul or outputs as many elements as the smallest block of scores
    [b, nh, s/2cp, s/2cp]."""
    per_rank = run_on_ranks(4, ring_attention_on_rank)
    b, s, nh, _, _ = RING_SHAPE
    *qkv, dout = whole_sequence_attention_inputs()
    q, k, v = (t.requires_grad_() for t in qkv)
    reference = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                               enable_gqa=True).transpose(1, 2)
    reference.backward(dout)
    out = torch.empty_like(reference)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    for rank in per_rank:
        out[:, rank["index"]] = rank["out"]
        for grad, local in zip(grads, rank["grads"]):
            grad[:, rank["index"]] = local
        names = {name for name, _ in rank["calls"]}
        assert {"_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_flash_attention_for_cpu_backward"} <= names
        assert not names & {"mm", "bmm", "matmul", "baddbmm", "addmm"}, names
        assert max(numel for _, numel in rank["calls"]) < b * nh * (s // 8) ** 2
    assert_close_relative(out, reference.detach(), rel=1e-5)
    for grad, tensor in zip(grads, (q, k, v)):
        assert_close_relative(grad, tensor.grad, rel=1e-5)


# ---------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("argv, expected", [
    (["--seq-length", "100", "--max-position-embeddings", "100", "--context-parallel-size", "4"],
     "seq-length (100) must be divisible by 2 x context-parallel-size (8)"),
    (["--model-preset", "gpt2-124m", "--context-parallel-size", "2"],
     "attention-dropout (0.1) must be 0 with context-parallel-size > 1"),
    (["--num-attention-heads", "6", "--hidden-size", "96", "--num-query-groups", "6", "--context-parallel-size", "4",
      "--cp-comm-type", "a2a"],
     "num-attention-heads per tensor-parallel rank (6) must be divisible by context-parallel-size (4) with "
     "--cp-comm-type a2a"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "3"],
     "hierarchical-context-parallel-sizes A x B (2 x 3) must equal context-parallel-size (4)"),
    (["--num-attention-heads", "6", "--hidden-size", "96", "--num-query-groups", "6", "--context-parallel-size", "4",
      "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4", "1"],
     "num-attention-heads per tensor-parallel rank (6) must be divisible by the a2a size A (4)"),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"],
     "--hierarchical-context-parallel-sizes acts only with --cp-comm-type a2a+p2p"),
    (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"],
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A B"),
])
def test_bad_cp_input_is_one_line_error(argv, expected, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        code = pretrain_gpt.main(["--model-preset", "llama-tiny", "--mock-data", *argv])
    assert code == 2
    lines = stderr.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error (rank 0): ") and expected in lines[0], lines
    with pytest.raises(ConfigError, match="context-parallel-size"):
        make_config({"model_preset": "llama-tiny", "mock_data": True, "seq_length": 100,
                     "max_position_embeddings": 100, "context_parallel_size": 4}, 4)


# ---------------------------------------------------------------------------------------------------
# Training: CP composed with TP + SP, DP and PP equals one process


TRAIN = {**LLAMA, "micro_batch_size": 2, "global_batch_size": 4, "train_iters": EQUIVALENCE_ITERS, "lr": 3e-3,
         "lr_warmup_iters": 1, "eval_interval": 1000, "log_interval": 1000}
LAYOUTS = {
    "cp2_tp2_sp": {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True},
    "cp2_dp2_a2a": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
    "cp2_dp2_allgather_recompute": {"context_parallel_size": 2, "cp_comm_type": "allgather",
                                    "recompute_granularity": "full"},
    "cp2_pp2": {"context_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "cp4_a2a_p2p_2x2": {"context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
                        "hierarchical_context_parallel_sizes": [2, 2]},
}


def train(values: dict, world_size: int):
    config = make_config(values, world_size)
    return [(h["lm_loss"], h["grad_norm"]) for h in pretrain(config, pretrain_gpt.model_provider,
                                                              pretrain_gpt.forward_step)]


def train_layouts(layouts: dict) -> dict:
    return {name: train({**TRAIN, **extra}, 4) for name, extra in layouts.items()}


def test_cp_with_tp2_sp_dp2_pp2_and_a2a_p2p_trains_as_one_process():
    reference = train(TRAIN, 1)
    per_rank = run_on_ranks(4, train_layouts, LAYOUTS)
    for name in LAYOUTS:
        for rank, history in enumerate(r[name] for r in per_rank):
            assert len(history) == TRAIN["train_iters"]
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, reference)):
                assert loss == pytest.approx(ref_loss, rel=1e-5), (name, rank, step)
                assert norm == pytest.approx(ref_norm, rel=1e-5), (name, rank, step)
    assert reference[-1][0] < reference[0][0]
