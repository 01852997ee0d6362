"""The tools around supervised fine-tuning: tools/preprocess_data.py --sft writes the tokens and assistant masks
that give exactly the samples of the conversations file itself; tools/generate.py --chat asks a fine-tuned model
with its chat template and stops at the end of its turn; the Hugging Face export carries the chat template, so that
lm-eval's --apply_chat_template asks the exported model as it was taught."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.chat_data import CHATML, CONVERSATIONS, write_messages, write_tokenizer
from tests.helpers import convert

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


# -------------------------------------------------------------------------------------------------------
# A tiny Llama fine-tuned on the conversations until it answers them; its tokenizer's eos is ChatML's <|im_end|>


def fine_tune(root: Path, tokenizer: str, **values) -> str:
    import pretrain_gpt
    from megatron_lite.config.arguments import make_config
    from megatron_lite.training.loop import pretrain

    config = make_config({**SFT, "micro_batch_size": 4, "global_batch_size": 4, "lr": 1e-2, "lr_warmup_iters": 2,
                          "data_path": [write_messages(root / "chat.jsonl", repeat=2)], "split": "100,0,0",
                          "tokenizer_model": tokenizer, "save": str(root / "run"), **values})
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    return str(root / "run")


@pytest.fixture(scope="module")
def fine_tuned(tokenizer, tmp_path_factory) -> str:
    return fine_tune(tmp_path_factory.mktemp("sft"), tokenizer, train_iters=60, save_interval=60)


def chatml(messages: list[dict]) -> str:
    """The ChatML text of `messages` and the header that opens the assistant's turn, written out by hand."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def chat(monkeypatch, capsys, *argv: str) -> tuple[list[int], list[str]]:
    """tools/generate.py --chat ARGV: the prompt ids the model was given, and the lines printed."""
    from megatron_lite.inference import generation
    from tools import generate as generate_tool

    prompts, real = [], generation.generate
    monkeypatch.setattr(generation, "generate", lambda model, ids, *a, **k: prompts.append(ids[0].tolist())
                        or real(model, ids, *a, **k))
    assert generate_tool.main(["--chat", "--greedy", "--output-ids", *argv]) == 0
    return prompts[0], capsys.readouterr().out.strip().splitlines()


def test_generate_chat_renders_the_chat_template_and_stops_at_the_end_of_the_turn(fine_tuned, tokenizer, monkeypatch,
                                                                                 capsys):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(tokenizer)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    system, question = CONVERSATIONS[0][0]["content"], CONVERSATIONS[0][1]["content"]
    prompt, lines = chat(monkeypatch, capsys, "--load", fine_tuned, "--system", system, "--prompt", question,
                         "--max-new-tokens", "20")
    assert prompt == hf(chatml([{"role": "system", "content": system}, {"role": "user", "content": question}]),
                        add_special_tokens=False)["input_ids"]
    reply, ids = lines[0], [int(i) for i in lines[1].split()]
    assert reply == "Paris." and ids[-1] == eos and eos not in ids[:-1] and len(ids) < 20
    assert hf.decode(ids) == "Paris.<|im_end|>"
    prompt, lines = chat(monkeypatch, capsys, "--load", fine_tuned, "--prompt", "Say hello.", "--max-new-tokens", "20")
    assert prompt == hf(chatml([{"role": "user", "content": "Say hello."}]), add_special_tokens=False)["input_ids"]
    assert lines[0] == "Hello there!"


@pytest.mark.parametrize(("argv", "says"), [
    (["--chat", "--prompt-ids", "1 2"], "--chat takes the user's turn as --prompt TEXT"),
    (["--prompt", "hi", "--system", "be brief"], "--system acts only with --chat"),
    (["--prompt", "hi", "--sft-tokenizer-prompt-format", "chatml"], "--sft-tokenizer-prompt-format acts only with"),
])
def test_generate_chat_flag_mistakes_are_one_line(argv, says, capsys):
    from tools import generate as generate_tool

    with pytest.raises(SystemExit) as exit_:
        generate_tool.main(["--load", "unused", *argv])
    error = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and says in error and "\n" not in error, error


def test_the_export_of_a_fine_tuned_checkpoint_carries_its_chat_template(fine_tuned, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from megatron_lite.data.sft.chat_tokenizer import ChatTokenizer

    convert("--direction", "mlite-to-hf", "--load-dir", fine_tuned, "--save-dir", str(tmp_path / "hf"))
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for conversation in CONVERSATIONS:
        asked = conversation[:-1]
        text = exported.apply_chat_template(asked, tokenize=False, add_generation_prompt=True)
        assert text == chatml(asked)
        assert exported(text, add_special_tokens=False)["input_ids"] == ChatTokenizer(tokenizer).prompt(asked)


def test_a_chat_template_transformers_saved_beside_the_tokenizer_is_carried(tokenizer, tmp_path):
    """transformers (5 here) saves the template as chat_template.jinja, and tokenizer_config.json holds none."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from megatron_lite.hf.safetensors_files import copy_carried_files

    PreTrainedTokenizerFast.from_pretrained(tokenizer).save_pretrained(tmp_path / "saved")
    (tmp_path / "export").mkdir()
    copy_carried_files(str(tmp_path / "saved"), str(tmp_path / "export"))
    assert AutoTokenizer.from_pretrained(tmp_path / "export").chat_template == CHATML


def test_a_run_fine_tuned_with_a_named_prompt_format_chats_and_exports_with_it(tmp_path, monkeypatch, capsys):
    """--sft-tokenizer-prompt-format chatml over a tokenizer whose own template is another: generate --chat renders
    ChatML, and the export's template is ChatML."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    tokenizer = write_tokenizer(tmp_path / "tokenizer", template=plain)
    run = fine_tune(tmp_path, tokenizer, train_iters=2, lr_warmup_iters=1, sft_tokenizer_prompt_format="chatml")
    prompt, _ = chat(monkeypatch, capsys, "--load", run, "--prompt", "Say hello.", "--max-new-tokens", "2")
    hf = PreTrainedTokenizerFast.from_pretrained(tokenizer)
    assert prompt == hf(chatml([{"role": "user", "content": "Say hello."}]), add_special_tokens=False)["input_ids"]
    convert("--direction", "mlite-to-hf", "--load-dir", run, "--save-dir", str(tmp_path / "hf"))
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    hello = [{"role": "user", "content": "Say hello."}]
    assert exported.apply_chat_template(hello, tokenize=False, add_generation_prompt=True) == chatml(hello)
    assert "user: " not in (tmp_path / "hf" / "chat_template.jinja").read_text()


LM_EVAL_TASK = """task: chat_replies
dataset_path: json
dataset_kwargs:
  data_files: {path}
test_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_eval_with_the_chat_template_asks_the_exported_model_as_it_was_taught(fine_tuned, tmp_path):
    """lm-eval's hf model with apply_chat_template on the export: each request is the question rendered by the
    chat template with the assistant's header, and the fine-tuned model answers every one as it learnt; the
    megatron_lite model on the checkpoint itself asks and answers the same."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megatron_lite.evaluation.harness_model import MegatronLiteLM

    convert("--direction", "mlite-to-hf", "--load-dir", fine_tuned, "--save-dir", str(tmp_path / "hf"))
    asked = [(c[0]["content"], c[1]["content"]) for c in CONVERSATIONS if c[0]["role"] == "user"]  # first turns
    (tmp_path / "replies.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in asked))
    (tmp_path / "chat_replies.yaml").write_text(LM_EVAL_TASK.format(path=tmp_path / "replies.jsonl"))

    def evaluate(model, model_args=None) -> list[dict]:
        results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["chat_replies"],
                                          apply_chat_template=True, log_samples=True, batch_size=1, bootstrap_iters=0,
                                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
        assert results["results"]["chat_replies"]["exact_match,none"] == 1.0
        return sorted(results["samples"]["chat_replies"], key=lambda s: s["doc_id"])

    samples = evaluate("hf", f"pretrained={tmp_path / 'hf'},dtype=float32,device=cpu")
    assert [s["arguments"][0][0] for s in samples] == [chatml([{"role": "user", "content": q}]) for q, _ in asked]
    assert [s["filtered_resps"][0] for s in samples] == [a for _, a in asked]
    ours = evaluate(MegatronLiteLM(load=fine_tuned, batch_size=1))
    assert [(s["arguments"], s["filtered_resps"]) for s in ours] == [(s["arguments"], s["filtered_resps"])
                                                                     for s in samples]
