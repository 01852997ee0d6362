"""Documents in a packed sequence: --reset-position-ids, --reset-attention-mask, --eod-mask-loss.

Each property is checked against a plain computation written here: Megatron's loop over the EOD tokens for
the batch, a mask built entry by entry for attention, and the documents run one by one through the same model
for the packed loss. Context parallelism (ring and all-gather), tensor parallelism with sequence parallelism and
pipeline parallelism, trained with the three flags on mock data, equal one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pretrain_gpt
from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.data.mock import MockGPTDataset
from megatron_lite.model.attention.context_parallel import (
    CpuFlashKernel,
    RingAttention,
    document_spans,
    load_balanced_indices,
)
from megatron_lite.model.attention.self_attention import Documents, document_attention, flex_document_attention
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.loop import _collate
from tests.harness import run_on_ranks
from tests.helpers import assert_run_matches, train_and_collect
from tests.tolerances import assert_close_relative

VOCAB, SEQ = 16, 32  # mock data's EOD is VOCAB - 1, which a progression reaches every 16 tokens or less, or never
EOD = VOCAB - 1
FLAGS = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True}
LLAMA = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
         "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": VOCAB, "make_vocab_size_divisible_by": 8,
         "seq_length": SEQ, "max_position_embeddings": SEQ, "micro_batch_size": 2, "global_batch_size": 4,
         "train_iters": 3, "lr": 3e-3, "lr_warmup_iters": 1, "eval_interval": 1000, "log_interval": 1000, **FLAGS}
# GPT-2's learned positions; without biases, since Adam moves the key bias (zero gradient in exact arithmetic)
# on rounding noise alone, differently in each layout
GPT2 = {**LLAMA, "model_preset": "gpt2-124m", "num_attention_heads": 4, "num_query_groups": None,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "disable_bias_linear": True}


def mock_batch(num_samples: int = 4, **flags) -> dict[str, torch.Tensor]:
    dataset = MockGPTDataset(num_samples, SEQ, VOCAB, seed=5)
    return _collate([dataset[i] for i in range(num_samples)], eod=dataset.eod, **flags)


def documents_of(tokens: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of one sample: an EOD token ends its document."""
    bounds, start = [], 0
    for t, token in enumerate(tokens.tolist()):
        if token == EOD:
            bounds.append((start, t + 1))
            start = t + 1
    return bounds + [(start, len(tokens))] if start < len(tokens) else bounds


# ---------------------------------------------------------------------------------------------------
# The batch


def test_collate_follows_megatrons_document_loop():
    """Megatron's get_ltor_masks_and_position_ids, as its loop over the EOD positions, gives the same batch."""
    batch = mock_batch(**FLAGS)
    tokens = batch["tokens"]
    assert (tokens == EOD).sum() >= 2 * len(tokens), "mock samples should pack several documents"
    for b in range(len(tokens)):
        positions = torch.arange(SEQ)
        mask = torch.ones(SEQ, SEQ).tril()
        previous = 0
        for i in (tokens[b] == EOD).nonzero().flatten().tolist():
            mask[i + 1:, :i + 1] = 0
            positions[i + 1:] -= i + 1 - previous
            previous = i + 1
        assert torch.equal(batch["position_ids"][b], positions)
        ids = batch["document_ids"][b]
        assert torch.equal((ids[:, None] == ids[None, :]).float().tril(), mask)
        assert torch.equal(batch["loss_mask"][b], (tokens[b] != EOD).float())


def test_collate_without_flags_is_unchanged():
    dataset = MockGPTDataset(2, SEQ, VOCAB, seed=5)
    batch = _collate([dataset[i] for i in range(2)])
    assert torch.equal(batch["position_ids"], torch.arange(SEQ))
    assert torch.equal(batch["loss_mask"], torch.ones(2, SEQ))
    assert "document_ids" not in batch


def test_eod_mask_loss_drops_exactly_the_eod_positions():
    """forward_step's loss sums the per-token losses of every position whose input token is not an EOD."""
    config = make_config({**LLAMA, "reset_attention_mask": False, "reset_position_ids": False})
    model = pretrain_gpt.model_provider(config, ParallelState.single(), model_chunk_plans(config, 0)[0],
                                        torch.device("cpu"))
    batch = mock_batch(eod_mask_loss=True)
    output, loss_func = pretrain_gpt.forward_step(iter([batch]), model)
    loss_sum, num_tokens, _ = loss_func(output)
    keep = batch["tokens"] != EOD
    assert int(num_tokens) == int(keep.sum()) < batch["tokens"].numel()
    per_token = model(batch["tokens"], batch["position_ids"], batch["labels"]).detach()
    assert_close_relative(loss_sum.detach(), per_token[keep].sum(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------
# Attention


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on purpose here
def test_document_mask_and_flex_block_mask_equal_a_mask_built_entry_by_entry():
    ids = mock_batch(reset_attention_mask=True)["document_ids"]
    b, s = ids.shape
    expected = torch.tensor([[[ids[n, t] == ids[n, u] and u <= t for u in range(s)] for t in range(s)]
                             for n in range(b)]).unsqueeze(1)
    documents = Documents(ids, torch.device("cpu"))
    assert torch.equal(documents.attention_mask, expected)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(b, 4, s, 8, generator=generator)
    k, v = (torch.randn(b, 2, s, 8, generator=generator) for _ in range(2))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=expected, enable_gqa=True)
    assert_close_relative(document_attention(q, k, v, documents, 0.0), reference, rel=1e-6)
    assert_close_relative(flex_document_attention(q, k, v, documents), reference, rel=1e-6)


def test_document_spans_skip_blocks_no_document_spans():
    q_ids = torch.tensor([[2, 2, 3, 3], [0, 0, 0, 0]])
    k_ids = torch.tensor([[0, 1, 1, 2], [0, 0, 0, 0]])
    sample = lambda n: slice(n, n + 1)  # noqa: E731
    assert document_spans(q_ids, k_ids) == [(sample(0), slice(0, 2), slice(3, 4)),
                                            (sample(1), slice(0, 4), slice(0, 4))]
    assert document_spans(torch.tensor([[3, 4]]), torch.tensor([[1, 2]])) == []


class CountingKernel(CpuFlashKernel):
    calls: list = []

    @staticmethod
    def forward(q, k, v, causal, scale):
        CountingKernel.calls.append((q.shape[1], k.shape[1], causal))
        return CpuFlashKernel.forward(q, k, v, causal, scale)


def ring_with_documents(q, k, v, ids):
    """CP2 ring attention of this rank's chunks; its output, gradients and block-kernel calls."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    local = load_balanced_indices(q.shape[1], cp, rank)
    q, k, v = (t[:, local].clone().requires_grad_() for t in (q, k, v))
    CountingKernel.calls.clear()
    out = RingAttention.apply(q, k, v, dist.group.WORLD, CountingKernel, ids)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad, list(CountingKernel.calls)


def test_cp2_ring_applies_documents_per_block_and_skips_masked_blocks():
    """Rank 0 holds positions 0-3 and 12-15, rank 1 positions 4-11. The block kernel runs once per (sample,
    document) a block holds, and not at all where the block holds none; outputs and gradients equal masked SDPA
    on the whole sequence."""
    s = 16
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, s, 4, 8, generator=generator)
    k, v = (torch.randn(2, s, 2, 8, generator=generator) for _ in range(2))
    ids = torch.tensor([[0] * 4 + [1] * 12, [0] * 10 + [1] * 6])
    ranks = run_on_ranks(2, ring_with_documents, q, k, v, ids)

    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    mask = Documents(ids, torch.device("cpu")).attention_mask
    reference = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qr, kr, vr)), attn_mask=mask,
                                               enable_gqa=True).transpose(1, 2)
    reference.backward(torch.ones_like(reference))
    for rank, (out, dq, dk, dv, _calls) in enumerate(ranks):
        local = load_balanced_indices(s, 2, rank)
        assert_close_relative(out, reference[:, local].detach(), rel=1e-5, msg=f"rank {rank} output")
        assert_close_relative(dq, qr.grad[:, local], rel=1e-5, msg=f"rank {rank} dq")
        assert_close_relative(dk, kr.grad[:, local], rel=1e-5, msg=f"rank {rank} dk")
        assert_close_relative(dv, vr.grad[:, local], rel=1e-5, msg=f"rank {rank} dv")
    # (query rows, key rows, causal) of each kernel call: first the diagonal block, one causal square per
    # document; then rank 0's queries 12-15 against keys 4-11 (sample 1 shares only positions 10-11 with them)
    # and rank 1's queries 4-11 against keys 0-3 (sample 0 shares no document with them: no call)
    assert ranks[0][4] == [(4, 4, True)] * 4 + [(4, 8, False), (4, 2, False)]
    assert ranks[1][4] == [(8, 8, True), (6, 6, True), (2, 2, True), (6, 4, False)]


# ---------------------------------------------------------------------------------------------------
# The model: packed documents = documents one by one


def build(values: dict) -> GPTModel:
    return GPTModel(make_config(values).model, ParallelState.single(), padded_vocab=128, seed=3)


@pytest.mark.parametrize("values", [LLAMA, GPT2], ids=["llama-rope", "gpt2-learned-positions"])
def test_packed_loss_equals_documents_run_one_by_one(values):
    batch = mock_batch(**FLAGS)
    packed_model, single_model = build(values), build(values)
    packed = packed_model(batch["tokens"], batch["position_ids"], batch["labels"],
                          document_ids=batch["document_ids"])
    packed.sum().backward()

    one_by_one = torch.empty_like(packed)
    for b, tokens in enumerate(batch["tokens"]):
        for start, end in documents_of(tokens):
            loss = single_model(tokens[None, start:end], torch.arange(end - start),
                                batch["labels"][None, b, start:end])
            loss.sum().backward()
            one_by_one[b, start:end] = loss[0].detach()
    assert_close_relative(packed.detach(), one_by_one, rel=1e-5)
    reference = dict(single_model.named_global_parameters())
    for name, param in packed_model.named_global_parameters():
        assert_close_relative(param.grad, reference[name].grad, rel=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------------
# Parallel layouts, trained with the three flags, equal one process


MODELS = {"llama": LLAMA, "gpt2": GPT2}
LAYOUTS = [  # (model, layout): RoPE and learned positions, each [b, s] here
    ("llama", {"context_parallel_size": 2}),
    ("llama", {"context_parallel_size": 2, "cp_comm_type": "allgather"}),
    ("gpt2", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    ("llama", {"pipeline_model_parallel_size": 2}),
]


def train_layouts(layouts):
    return [train_and_collect({**MODELS[model], **layout}, 2) for model, layout in layouts]


def test_cp2_tp2_pp2_with_document_flags_match_one_process():
    """Losses of 3 steps, final weights and last gradients (tests/test_pipeline_parallel.assert_run_matches)."""
    per_rank = run_on_ranks(2, train_layouts, LAYOUTS)
    references = {model: train_and_collect(values, 1) for model, values in MODELS.items()}
    for index, (model, layout) in enumerate(LAYOUTS):
        try:
            assert_run_matches([ranks[index] for ranks in per_rank], references[model])
        except AssertionError as error:
            raise AssertionError(f"{model} {layout}: {error}") from None


def test_document_flags_refuse_what_cannot_run():
    with pytest.raises(ConfigError, match="attention-backend auto or sdpa"):
        make_config({**LLAMA, "attention_backend": "flash"})
    with pytest.raises(ConfigError, match="attention-dropout 0"):
        make_config({**GPT2, "attention_dropout": 0.1})
