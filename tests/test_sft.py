"""Supervised fine-tuning on conversations: assistant masks, packing, the loss, and bad input.

The references are written here: transformers' own assistant masks (a template with generation tags), Megatron's
SFTDataset packing from its definition (conversations end to end, each padded to 2 x cp, cut at seq_length + 1
with one padding token, padded to seq_length + 1), each conversation run alone through the same model, and the
token-level cross-entropy over the assistant's tokens.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.data.sft.chat_tokenizer import ChatTokenizer, load_hf_tokenizer
from megatron_lite.data.sft.conversations import ReadCounts, read_conversations
from megatron_lite.data.sft.sft_dataset import SFTDataset
from megatron_lite.data.sft.tokenized import load_conversations
from megatron_lite.errors import DataError
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState
from tests.chat_data import CONVERSATIONS, write_messages, write_tokenizer
from tests.tolerances import assert_close_relative

IGNORE = -100


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"tagged": write_tokenizer(root / "tagged", tagged=True), "plain": write_tokenizer(root / "plain")}


def transformers_masks(folder: str, conversation) -> tuple[list[int], list[int]]:
    out = load_hf_tokenizer(folder).apply_chat_template(conversation, tokenize=True, return_dict=True,
                                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_masks_equal_transformers_with_generation_tags_and_without_them(tokenizers, conversation):
    """Multi-turn, with system and tool turns: every assistant turn and its <|im_end|>, nothing else."""
    ids, mask = transformers_masks(tokenizers["tagged"], CONVERSATIONS[conversation])
    assert sum(mask) > 0
    for chat in (ChatTokenizer(tokenizers["tagged"]), ChatTokenizer(tokenizers["plain"]),
                 ChatTokenizer(tokenizers["plain"], "chatml")):
        tokens, assistant = chat.tokenize(CONVERSATIONS[conversation])
        assert tokens.tolist() == ids
        assert assistant.astype(int).tolist() == mask


def test_the_assistant_text_is_what_the_mask_keeps(tokenizers):
    chat = ChatTokenizer(tokenizers["plain"])
    tokens, mask = chat.tokenize(CONVERSATIONS[0])
    learnt = chat.tokenizer.decode(tokens[mask].tolist())
    assert learnt == "Paris.<|im_end|>It is raining, twelve degrees.<|im_end|>"


def test_a_template_that_renders_prefixes_otherwise_is_one_line(tmp_path):
    """A template whose last turn differs from how it renders inside a longer conversation has no exact mask."""
    template = ("{% for message in messages %}{% if loop.last %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                "message['content'] + '<|im_end|>' }}{% else %}{{ '<|im_start|>' + message['content'] + '\\n' }}"
                "{% endif %}{% endfor %}")
    chat = ChatTokenizer(write_tokenizer(tmp_path, template=template))
    with pytest.raises(DataError, match="cannot be found exactly; add {% generation %} tags"):
        chat.tokenize(CONVERSATIONS[1], "row 1")


def megatron_pack(conversations, seq_length: int, cp_size: int, pad: int) -> dict[str, np.ndarray]:
    """Megatron's SFTDataset.__getitem__ on (tokens, targets) per conversation, targets IGNORE off the assistant."""
    tokens, targets, positions = [], [], []
    for ids, mask in conversations:
        tokens += ids.tolist()
        targets += [t if m else IGNORE for t, m in zip(ids.tolist(), mask.tolist())]
        positions += list(range(len(ids)))
        if cp_size > 1 and len(tokens) % (2 * cp_size):
            extra = 2 * cp_size - len(tokens) % (2 * cp_size)
            tokens, targets = tokens + [pad] * extra, targets + [pad] * extra
            positions += list(range(positions[-1] + 1, positions[-1] + 1 + extra))
        if len(tokens) >= seq_length + 1:
            tokens, targets = tokens[:seq_length] + [pad], targets[:seq_length] + [pad]
            positions = positions[:seq_length + 1]
            break
    extra = seq_length + 1 - len(tokens)
    tokens, targets = tokens + [pad] * extra, targets + [pad] * extra
    positions += list(range(positions[-1] + 1, positions[-1] + 1 + extra))
    labels = np.array(targets[1:])
    return {"tokens": np.array(tokens[:-1]), "position_ids": np.array(positions[:-1]),
            "loss_mask": ((labels != pad) & (labels != IGNORE)).astype(np.float32)}


@pytest.mark.parametrize(("seq_length", "cp_size"), [(256, 1), (256, 2), (100, 1), (60, 4)])
def test_samples_equal_megatrons_sft_dataset(tokenizers, tmp_path, seq_length, cp_size):
    """Rows of two conversations (a system message starts the second), of one, cut or not, padded for CP or not."""
    rows = [CONVERSATIONS[0] + CONVERSATIONS[2], CONVERSATIONS[1] + CONVERSATIONS[3], CONVERSATIONS[2]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    chat = ChatTokenizer(tokenizers["plain"])
    source = load_conversations(str(path), chat, str(tmp_path / "cache"))
    pad = chat.tokenizer.pad_token_id
    dataset = SFTDataset(source, (0, 3), 5, seq_length, pad, cp_size)
    for i in range(5):
        expected = megatron_pack(source.row(i % 3), seq_length, cp_size, pad)
        sample = dataset[i]
        for key, value in expected.items():
            assert sample[key].tolist() == value.tolist(), (i, key)
        assert sample["labels"].tolist() == sample["tokens"][1:].tolist() + [sample["labels"][-1]]
    assert source.conversation_lengths(0).size == 2 and source.conversation_lengths(1).size == 1


def test_an_end_of_turn_inside_a_conversation_is_no_document_boundary(tokenizers, tmp_path):
    chat = ChatTokenizer(tokenizers["plain"])
    source = load_conversations(write_messages(tmp_path / "chat.jsonl"), chat, str(tmp_path / "cache"))
    sample = SFTDataset(source, (0, 4), 1, 160, chat.tokenizer.pad_token_id)[0]
    length = len(source.row(0)[0][0])
    end_of_turn = chat.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (sample["tokens"][:length] == end_of_turn).sum() == 6
    assert set(sample["document_ids"][:length].tolist()) == {0}
    assert sample["position_ids"][:length].tolist() == list(range(length))


@pytest.fixture(scope="module")
def packed(tokenizers, tmp_path_factory):
    """A batch of two samples, the first packing two conversations; the model config; the tokenizer."""
    root = tmp_path_factory.mktemp("packed")
    path = root / "rows.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0] + CONVERSATIONS[2]}) + "\n"
                    + json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    chat = ChatTokenizer(tokenizers["plain"])
    source = load_conversations(str(path), chat, str(root / "cache"))
    dataset = SFTDataset(source, (0, 2), 2, 256, chat.tokenizer.pad_token_id)
    batch = torch.utils.data.default_collate([dataset[0], dataset[1]])
    config = make_config({"model_preset": "llama-tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                          "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 300, "seq_length": 256,
                          "max_position_embeddings": 256, "mock_data": True})
    return batch, source, config


def build(config) -> GPTModel:
    return GPTModel(config.model, ParallelState.single(), padded_vocab=384, seed=3)


def test_the_packed_losses_equal_each_conversation_run_alone(packed):
    batch, source, config = packed
    model = build(config)
    losses = model(batch["tokens"], batch["position_ids"], batch["labels"], document_ids=batch["document_ids"])
    conversations = source.row(0) + source.row(1)
    starts = [(0, 0), (0, len(conversations[0][0])), (1, 0)]
    for (b, start), (ids, _) in zip(starts, conversations):
        n = len(ids) - 1
        alone = model(torch.tensor(ids[None, :-1], dtype=torch.long), torch.arange(n),
                      torch.tensor(ids[None, 1:], dtype=torch.long))
        assert_close_relative(losses[b, start:start + n].detach(), alone[0].detach(), rel=1e-5)


def test_the_loss_is_the_cross_entropy_over_the_assistant_tokens(packed, tokenizers):
    """The trainer's micro-batch loss: sum over the tokens transformers marks as the assistant's (the labels whose
    mask is 1 within their conversation), divided by their number."""
    batch, source, config = packed
    model = build(config)
    output, loss_func = pretrain_gpt.forward_step(iter([batch]), model)
    loss_sum, tokens, _ = loss_func(output)
    logits = model(batch["tokens"], batch["position_ids"], document_ids=batch["document_ids"]).float()
    expected_sum, expected_tokens = 0.0, 0
    second = len(source.row(0)[0][0])
    for b, start, conversation in [(0, 0, CONVERSATIONS[0]), (0, second, CONVERSATIONS[2]), (1, 0, CONVERSATIONS[1])]:
        ids, mask = transformers_masks(tokenizers["tagged"], conversation)
        for t in range(1, len(ids)):
            if mask[t]:
                expected_sum += F.cross_entropy(logits[b, start + t - 1, :300], torch.tensor(ids[t])).item()
                expected_tokens += 1
    assert tokens.item() == expected_tokens
    assert loss_sum.item() == pytest.approx(expected_sum, rel=1e-5)


def test_a_micro_batch_without_assistant_tokens_contributes_zero_without_nan(packed):
    batch, _, config = packed
    silent = {**batch, "loss_mask": torch.zeros_like(batch["loss_mask"])}
    model = build(config)
    output, loss_func = pretrain_gpt.forward_step(iter([silent]), model)
    loss_sum, tokens, _ = loss_func(output)
    assert tokens.item() == 0 and loss_sum.item() == 0.0
    loss_sum.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_layouts_are_read_from_the_columns(tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
            {"instruction": "Add", "input": "2 and 3", "output": "5"}, {"text": "plain words"}]
    expected = [[[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]],
                [[{"role": "user", "content": "Add\n\n2 and 3"}, {"role": "assistant", "content": "5"}]],
                ["plain words"]]
    for row, conversations in zip(rows, expected):
        path = tmp_path / "one.jsonl"
        path.write_text(json.dumps(row) + "\n")
        assert [c for _, c in read_conversations(str(path), ReadCounts())] == [conversations]


BAD_ROWS = {
    "unknown role": ({"messages": [{"role": "narrator", "content": "x"}]}, "turn 0 has the unknown role 'narrator'"),
    "content not a string": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                             "turn 0 (user) has list content; SFT reads text content only"),
    "another layout than the first row's": ({"question_text": "x", "reply": "y"},
                                            "row 2 has no 'messages' column, which the file's first row has"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_is_one_line_naming_it(tmp_path, case):
    row, expected = BAD_ROWS[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=re.escape(expected)) as error:
        list(read_conversations(str(path), ReadCounts()))
    assert "\n" not in str(error.value) and "bad.jsonl row 2" in str(error.value)


def test_a_file_of_no_known_layout_is_one_line_naming_its_columns(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question_text": "x", "reply": "y"}) + "\n")
    with pytest.raises(DataError, match=re.escape("cannot tell the conversation layout from the columns ['question_"
                                                  "text', 'reply']")):
        list(read_conversations(str(path), ReadCounts()))


def test_conversations_without_an_assistant_turn_are_counted_and_skipped(tmp_path):
    path = write_messages(tmp_path / "chat.jsonl", [CONVERSATIONS[1], [{"role": "user", "content": "Anyone?"}]])
    counts = ReadCounts()
    assert [c for _, c in read_conversations(path, counts)] == [[CONVERSATIONS[1]]]
    assert (counts.rows, counts.conversations, counts.without_assistant, counts.skipped_rows) == (2, 1, 1, 1)


def _bad_runs(root) -> dict[str, tuple[list[str], str]]:
    """(argv, the line expected) of each bad input, with the files it needs written under `root`."""
    tokenizer = write_tokenizer(root / "tokenizer")
    broken = write_tokenizer(root / "broken", template="{% for m in messages %}{{ m.content | no_such_filter }}"
                                                       "{% endfor %}")
    (root / "empty.jsonl").write_text("")
    (root / "narrator.jsonl").write_text(json.dumps({"messages": [{"role": "narrator", "content": "Once"}]}) + "\n")
    silent = write_messages(root / "silent.jsonl", [[{"role": "user", "content": "Anyone?"}]])
    chat = write_messages(root / "chat.jsonl")
    base = ["--model-preset", "llama-tiny", "--num-layers", "2", "--seq-length", "64", "--train-iters", "2",
            "--split", "1", "--device", "cpu", "--sft", "--tokenizer-type", "HuggingFaceTokenizer"]
    return {
        "an empty file": (base + ["--tokenizer-model", tokenizer, "--data-path", str(root / "empty.jsonl")],
                          "empty.jsonl is empty; write one conversation per line"),
        "an unknown role": (base + ["--tokenizer-model", tokenizer, "--data-path", str(root / "narrator.jsonl")],
                            "narrator.jsonl row 1: turn 0 has the unknown role 'narrator'"),
        "no assistant turn at all": (base + ["--tokenizer-model", tokenizer, "--data-path", silent],
                                     "holds no conversation with an assistant turn (1 rows read)"),
        "a template error": (base + ["--tokenizer-model", broken, "--data-path", chat],
                             "the chat template fails on"),
        "--sft with --mock-data": (base + ["--tokenizer-model", tokenizer, "--mock-data"],
                                   "--sft and --mock-data exclude each other"),
        "--sft with a sentencepiece tokenizer": (
            [*base[:-1], "SentencePieceTokenizer", "--tokenizer-model", tokenizer, "--data-path", chat],
            "pass --tokenizer-type HuggingFaceTokenizer"),
    }


def test_bad_sft_input_fails_with_one_line_before_compute(tmp_path, capsys):
    """Each in one process, as pretrain_gpt.py runs it: exit status non-zero, one line on stderr, no step."""
    for case, (argv, expected) in _bad_runs(tmp_path).items():
        status = pretrain_gpt.main(argv + ["--metrics-jsonl", str(tmp_path / f"{case}.jsonl")])
        captured = capsys.readouterr()
        errors = [line for line in captured.err.splitlines() if line.startswith("error")]
        assert status != 0 and len(errors) == 1 and expected in errors[0], (case, captured.err[-2000:])
        assert " iteration " not in captured.out, case


def test_a_bad_conversation_stops_every_rank_with_one_line(tmp_path):
    from tests.test_cli_errors import fails_on_every_rank_with_one_line

    fails_on_every_rank_with_one_line(*_bad_runs(tmp_path)["an unknown role"])


def test_long_conversations_are_truncated_or_dropped_and_counted(tokenizers, tmp_path):
    """Rows [0+2] (two conversations) and [1]: with room for the first conversation of row 0 but not the second,
    truncation cuts the second (counted), dropping leaves it out; row 1 fits either way."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATIONS[0] + CONVERSATIONS[2]}) + "\n"
                    + json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    chat = ChatTokenizer(tokenizers["plain"])
    source = load_conversations(str(path), chat, str(tmp_path / "cache"))
    first = len(source.row(0)[0][0])
    pad = chat.tokenizer.pad_token_id
    truncated = SFTDataset(source, (0, 2), 2, first + 20, pad)
    dropped = SFTDataset(source, (0, 2), 2, first + 20, pad, long_conversations="drop")
    assert (truncated.counts.truncated, truncated.counts.dropped) == (1, 0)
    assert (dropped.counts.truncated, dropped.counts.dropped) == (0, 1)
    assert truncated[0]["document_ids"][first:].tolist() == [1] * 20
    assert (truncated[0]["tokens"][first:first + 19] != pad).all()
    assert dropped[0]["document_ids"][first:].tolist() == [0] * 20  # padding after the first conversation
    assert (dropped[0]["tokens"][first:] == pad).all() and dropped[0]["loss_mask"][first - 1:].sum() == 0


def test_a_global_batch_without_assistant_tokens_trains_to_the_end_without_nan(tokenizers, tmp_path):
    """Samples cut before any assistant turn: the loss is 0 and the run finishes (no NaN stops it)."""
    from tests.helpers import train_losses

    values = {"model_preset": "llama-tiny", "num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
              "num_attention_heads": 2, "seq_length": 8, "micro_batch_size": 1, "global_batch_size": 2,
              "train_iters": 2, "eval_interval": 1000, "sft": True, "split": "1",
              "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizers["plain"],
              "data_path": [write_messages(tmp_path / "chat.jsonl")],
              "check_for_nan_in_loss_and_grad": True}
    assert train_losses(values, 1) == [0.0, 0.0]


def test_parquet_and_saved_datasets_read_as_json_lines(tmp_path):
    import datasets

    rows = [{"messages": conversation} for conversation in CONVERSATIONS]
    expected = [c for _, c in read_conversations(write_messages(tmp_path / "chat.jsonl"), ReadCounts())]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "chat.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "chat.parquet", tmp_path / "saved"):
        assert [c for _, c in read_conversations(str(path), ReadCounts())] == expected, path


def test_a_weighted_blend_of_two_files_interleaves_their_rows_by_weight(tokenizers, tmp_path):
    """The first file's rows are all CONVERSATIONS[1], the second's CONVERSATIONS[3]: weights 1:3 give one in four
    samples from the first, and the validation split gets each file's last rows."""
    from megatron_lite.data.sft.builder import build_sft_datasets

    first = write_messages(tmp_path / "a.jsonl", [CONVERSATIONS[1]], repeat=10)
    second = write_messages(tmp_path / "b.jsonl", [CONVERSATIONS[3]], repeat=10)
    config = make_config({"model_preset": "llama-tiny", "seq_length": 96, "max_position_embeddings": 96, "sft": True,
                          "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tokenizers["plain"],
                          "data_path": ["1", first, "3", second], "split": "80,20,0"})
    train, valid, test = build_sft_datasets(config, (8, 4, 0), log=lambda line: None)
    second_ids = ChatTokenizer(tokenizers["plain"]).tokenize(CONVERSATIONS[3])[0]
    from_second = [train[i]["tokens"][:len(second_ids)].tolist() == second_ids.tolist() for i in range(len(train))]
    assert len(train) == 8 and sum(from_second) == 6 and from_second[0]  # Megatron's greedy: the heavier first
    assert len(valid) >= 4 and test is None
