"""The tools around supervised fine-tuning: tools/preprocess_data.py --sft writes the tokens and assistant masks
that give exactly the samples of the conversations file itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.chat_data import CONVERSATIONS, write_tokenizer

REPO = Path(__file__).resolve().parents[1]
SFT = {"model_preset": "llama-tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
       "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 96, "max_position_embeddings": 96,
       "micro_batch_size": 1, "global_batch_size": 2, "train_iters": 3, "lr": 3e-3, "lr_warmup_iters": 1,
       "eval_interval": 1000, "log_interval": 1000, "sft": True, "tokenizer_type": "HuggingFaceTokenizer"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return write_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer")


def write_rows(path: Path) -> str:
    """Rows of one conversation, of two (a system turn starts the second), and of none with an assistant turn."""
    rows = [{"messages": c} for c in CONVERSATIONS]
    rows.append({"messages": CONVERSATIONS[1] + CONVERSATIONS[2]})
    rows.append({"messages": [{"role": "user", "content": "Nobody answers this."}]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows * 3))
    return str(path)


def preprocess(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/preprocess_data.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_a_preprocessed_prefix_gives_the_samples_of_its_conversations_file(tokenizer, tmp_path):
    from megatron_lite.config.arguments import make_config
    from megatron_lite.data.sft.builder import build_sft_datasets

    chat = write_rows(tmp_path / "chat.jsonl")
    done = preprocess("--sft", "--input", chat, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                      "HuggingFaceTokenizer", "--tokenizer-model", tokenizer)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path}/out_sft.bin/.idx and {tmp_path}/out_sft_assistant_mask.bin/.idx: "
                                  f"18 rows, 18 conversations, ")
    assert "left out: 3 conversations without an assistant turn, 3 rows without a conversation" in done.stdout

    def samples(data_path: str) -> list[list[dict]]:
        config = make_config({**SFT, "data_path": [data_path], "split": "70,30,0", "tokenizer_model": tokenizer,
                              "data_cache_path": str(tmp_path / "cache")})
        return [[dataset[i] for i in range(len(dataset))]
                for dataset in build_sft_datasets(config, (12, 6, 0), log=lambda line: None)[:2]]

    from_prefix, from_file = samples(str(tmp_path / "out_sft")), samples(chat)
    assert [len(split) for split in from_prefix] == [12, 6]
    for ours, theirs in zip(from_prefix, from_file):
        for sample, expected in zip(ours, theirs):
            assert sample.keys() == expected.keys()
            for key in sample:
                np.testing.assert_array_equal(sample[key], expected[key], err_msg=key)
    assert any(sample["loss_mask"].any() for sample in from_prefix[1])


@pytest.mark.parametrize(("argv", "says"), [
    (["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"], "--sft renders conversations with a Hugging Face"),
    (["--tokenizer-type", "HuggingFaceTokenizer"], "--sft needs --tokenizer-model"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{tok}", "--json-keys", "text", "--workers",
      "2"], "--json-keys, --workers does not apply to --sft"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{tok}", "--input", "{tmp}/absent.jsonl"],
     "input {tmp}/absent.jsonl not found; check --input"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "{tok}", "--input", "{tmp}/bad.jsonl"],
     "{tmp}/bad.jsonl row 1: turn 0 has the unknown role 'robot'"),
])
def test_bad_sft_inputs_are_one_line(argv, says, tokenizer, tmp_path):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "robot", "content": "beep"}]}) + "\n")
    argv = [arg.format(tok=tokenizer, tmp=tmp_path) for arg in argv]
    if "--input" not in argv:
        argv += ["--input", write_rows(tmp_path / "chat.jsonl")]
    done = preprocess("--sft", "--output-prefix", str(tmp_path / "out"), *argv)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("preprocess_data.py: error: ") and says.format(tmp=tmp_path) in last
    assert not list(tmp_path.glob("out*"))
