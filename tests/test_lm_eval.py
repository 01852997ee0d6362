"""lm-evaluation-harness scores a megatron_lite checkpoint as its own `hf` model scores the Hugging Face model.

A random Llama (GQA, untied) with a word-level tokenizer is converted to megatron_lite; three local tasks (no
download: JSON lines written here) ask for each request kind: multiple choice (loglikelihood; acc and
acc_norm), a rolling log-likelihood (perplexity) and greedy generation (exact match). lm-eval's `hf` model on
the Hugging Face directory is the reference: every request's log-likelihood, every generated string and every
metric equal (fp32, to float rounding).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_entry_on_ranks
from tests.helpers import HF_VOCAB, convert, hf_config, word_level_tokenizer
from tests.test_tool_inputs import one_line_error
from tests.tolerances import assert_close_relative

TASKS = {
    "words_choice": """task: words_choice
dataset_path: json
dataset_kwargs:
  data_files: {path}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "words_rolling": """task: words_rolling
dataset_path: json
dataset_kwargs:
  data_files: {path}
test_split: train
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
    "words_generate": """task: words_generate
dataset_path: json
dataset_kwargs:
  data_files: {path}
test_split: train
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w7"]
  max_gen_toks: 5
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1, HF_VOCAB - 1)}" for _ in range(n))


def _documents(task: str, rng: random.Random) -> list[dict]:
    if task == "words_choice":
        return [{"context": _words(rng, rng.randrange(3, 9)), "choices": [_words(rng, rng.randrange(1, 4))
                                                                          for _ in range(4)], "gold": i % 4}
                for i in range(7)]
    if task == "words_rolling":  # longer than the model's 64 positions: several windows
        return [{"text": _words(rng, rng.randrange(20, 150))} for _ in range(3)]
    return [{"context": _words(rng, rng.randrange(3, 9)), "answer": _words(rng, 2)} for _ in range(5)]


@pytest.fixture(scope="module")
def models_and_tasks(tmp_path_factory) -> tuple[str, str, str]:
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("lm_eval")
    hf_dir, mlite_dir, task_dir = root / "hf", root / "mlite", root / "tasks"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config("llama")).save_pretrained(hf_dir)
    PreTrainedTokenizerFast(tokenizer_object=word_level_tokenizer(), eos_token="</s>").save_pretrained(hf_dir)
    convert("--direction", "hf-to-mlite", "--load-dir", str(hf_dir), "--save-dir", str(mlite_dir))
    task_dir.mkdir()
    rng = random.Random(0)
    for task, template in TASKS.items():
        data = task_dir / f"{task}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in _documents(task, rng)))
        (task_dir / f"{task}.yaml").write_text(template.format(path=data))
    return str(hf_dir), str(mlite_dir), str(task_dir)


def evaluate(model, model_args: str | None, task_dir: str, tasks=tuple(TASKS), limit: int | None = None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), log_samples=True,
                                   task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                                   batch_size=4, bootstrap_iters=0, limit=limit)


def test_harness_scores_equal_the_hf_models_on_the_export(models_and_tasks, hf_scores):
    from megatron_lite.evaluation.harness_model import MegatronLiteLM

    _, mlite_dir, task_dir = models_and_tasks
    ours = evaluate(MegatronLiteLM(load=mlite_dir, batch_size=4), None, task_dir)
    _compare(ours, hf_scores, TASKS)
    generated = [s["resps"][0][0] for s in ours["samples"]["words_generate"]]
    assert any(generated), "greedy generation produced only empty strings: the comparison would be vacuous"


def _compare(ours: dict, theirs: dict, tasks) -> None:
    """Every request's answer and every metric of `ours` equal `theirs` (log-likelihoods to float rounding).

    The answers compared are the filtered responses, the ones the metrics score: under data parallelism lm-eval
    evens out the ranks' request counts by repeating a short rank's last request, whose second answer it appends
    to that request's raw `resps` (for its hf model as for ours)."""
    for task in tasks:
        our_samples = sorted(ours["samples"][task], key=lambda s: (s["doc_id"], s["filter"]))
        their_samples = sorted(theirs["samples"][task], key=lambda s: (s["doc_id"], s["filter"]))
        assert len(our_samples) == len(their_samples) > 0
        for mine, reference in zip(our_samples, their_samples):
            answers, expected = mine["filtered_resps"], reference["filtered_resps"]
            if isinstance(expected[0], str):  # generated text
                assert answers == expected, task
                continue
            scores = [answer[0] if isinstance(answer, (list, tuple)) else answer for answer in answers]
            wanted = [answer[0] if isinstance(answer, (list, tuple)) else answer for answer in expected]
            assert_close_relative(torch.tensor(scores, dtype=torch.float64),
                                  torch.tensor(wanted, dtype=torch.float64), rel=1e-5, msg=task)
        for metric, value in theirs["results"][task].items():
            if "," in metric and "_stderr" not in metric and isinstance(value, float):
                assert ours["results"][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)


@pytest.fixture(scope="module")
def hf_scores(models_and_tasks) -> dict:
    hf_dir, _, task_dir = models_and_tasks
    return evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu", task_dir)


@pytest.mark.parametrize("ranks,layout", [(4, (2, 2)), (2, (1, 1))], ids=["tp2xpp2", "dp2"])
def test_scores_at_tp2_pp2_and_dp2_on_several_ranks_equal_the_hf_models(models_and_tasks, hf_scores, ranks, layout,
                                                                         tmp_path):
    """On ranks started as torchrun starts them: heads split over TP and the layers over two pipeline stages
    (four processes), or the requests over two data-parallel replicas (lm-eval splits them by rank and gathers to
    rank 0; every task has an odd number of documents, so one rank holds fewer and lm-eval pads it)."""
    _, mlite_dir, task_dir = models_and_tasks
    out = tmp_path / "results.pt"
    runs = run_entry_on_ranks(ranks, [str(out), mlite_dir, task_dir, *map(str, layout), *TASKS],
                              {"HF_DATASETS_OFFLINE": "1"}, timeout=600, entry="tests.lm_eval_on_ranks")
    assert all(run.code == 0 for run in runs), "".join(run.stderr for run in runs)[-4000:]
    _compare(torch.load(out, weights_only=False), hf_scores, TASKS)


def test_model_args_it_does_not_take_are_one_line(models_and_tasks):
    from megatron_lite.errors import ConfigError
    from megatron_lite.evaluation.harness_model import MegatronLiteLM

    _, mlite_dir, _ = models_and_tasks
    with pytest.raises(ConfigError, match=r"takes no 'pretrained'; the megatron_lite model reads a checkpoint "
                                          r"directory: load=DIR"):
        MegatronLiteLM.create_from_arg_string(f"pretrained={mlite_dir}")
    with pytest.raises(ConfigError, match=r"takes no 'itertion'; did you mean iteration\?"):
        MegatronLiteLM.create_from_arg_string(f"load={mlite_dir},itertion=0", {"batch_size": 4, "device": "cpu"})
    with pytest.raises(ConfigError, match=r"give the checkpoint, load=DIR"):
        MegatronLiteLM.create_from_arg_string("", {"batch_size": 4, "max_batch_size": None})
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size x pipeline_model_parallel_size \(2 x 1\) "
                                          r"must divide the 1 process\(es\)"):
        MegatronLiteLM.create_from_arg_string(f"load={mlite_dir},tensor_model_parallel_size=2")


def test_a_checkpoint_without_a_tokenizer_is_one_line(tmp_path):
    from megatron_lite.errors import CheckpointError
    from megatron_lite.evaluation.harness_model import MegatronLiteLM

    torch.manual_seed(0)
    hf_dir = tmp_path / "hf"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(hf_config("llama")).save_pretrained(hf_dir)
    convert("--direction", "hf-to-mlite", "--load-dir", str(hf_dir), "--save-dir", str(tmp_path / "mlite"))
    with pytest.raises(CheckpointError, match="has no tokenizer .*pass tokenizer_type=...,tokenizer_model=..."):
        MegatronLiteLM(load=str(tmp_path / "mlite"))


def run_lm_eval(*argv: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / "tools" / "run_lm_eval.py"), "--model", "megatron_lite", *argv],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})


def test_run_lm_eval_runs_the_harness_command_line(models_and_tasks, tmp_path):
    _, mlite_dir, task_dir = models_and_tasks
    result = run_lm_eval("--model_args", f"load={mlite_dir}", "--include_path", task_dir, "--tasks", "words_choice",
                         "--output_path", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "words_choice" in result.stdout and "acc" in result.stdout


def test_an_unknown_task_or_missing_task_data_is_one_line(models_and_tasks, tmp_path, capsys):
    """The tool's main in this process (the command line itself is run above): lm-eval's imports are done once."""
    _, mlite_dir, task_dir = models_and_tasks
    missing = (Path(task_dir) / "words_choice.yaml").read_text().replace("task: words_choice", "task: no_data")
    (tmp_path / "no_data.yaml").write_text(missing.replace(str(Path(task_dir) / "words_choice.jsonl"),
                                                           str(tmp_path / "absent.jsonl")))
    for argv, says in ((["--tasks", "no_such_task"], "Tasks not found: no_such_task"),
                       (["--include_path", str(tmp_path), "--tasks", "no_data"], "absent.jsonl")):
        error = one_line_error("run_lm_eval", ["--model", "megatron_lite", "--model_args", f"load={mlite_dir}", *argv],
                               capsys, 1)
        assert says in error, error


def test_downstream_scores_during_training_equal_the_harness_on_the_checkpoints_saved_there(models_and_tasks,
                                                                                          tmp_path, monkeypatch):
    """--eval-tasks scores the live model every --eval-interval iterations; each logged score (JSONL, TensorBoard,
    W&B) equals tools/run_lm_eval.py's model on the checkpoint saved at that iteration, a resumed run goes on
    logging them, and the trained checkpoint, exported to Hugging Face, scores the same with lm-eval's hf model."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import pretrain_gpt
    from megatron_lite.config.arguments import make_config
    from megatron_lite.evaluation.harness_model import MegatronLiteLM
    from megatron_lite.evaluation.in_training import DownstreamEvaluation
    from megatron_lite.training.loop import pretrain
    from tests.wandb_records import read_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    hf_dir, _, task_dir = models_and_tasks
    tasks = ("words_choice", "words_generate")
    values = {"model_preset": "llama-tiny", "num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
              "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": HF_VOCAB, "seq_length": 64,
              "max_position_embeddings": 64, "mock_data": True, "tokenizer_type": "HuggingFaceTokenizer",
              "tokenizer_model": hf_dir, "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 4,
              "lr": 3e-3, "eval_interval": 2, "eval_iters": 1, "log_interval": 1, "save": str(tmp_path / "run"),
              "load": str(tmp_path / "run"), "save_interval": 2, "metrics_jsonl": str(tmp_path / "metrics.jsonl"),
              "tensorboard_dir": str(tmp_path / "tb"), "wandb_project": "downstream", "wandb_exp_name": "tiny",
              "wandb_save_dir": str(tmp_path),
              "eval_tasks": [str(Path(task_dir) / f"{task}.yaml") for task in tasks], "eval_task_limit": 4}
    for train_iters in (4, 6):  # the second run resumes from iteration 4
        config = make_config({**values, "train_iters": train_iters}, 1)
        pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step,
                 non_loss_data_func=DownstreamEvaluation(config))
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if "downstream/words_choice/acc" in line]
    assert [record["iteration"] for record in logged] == [2, 4, 6]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    first_run = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))[0]
    in_wandb = [record for record in read_run(first_run)["history"] if "downstream/words_choice/acc" in record]
    names = ("words_choice/acc", "words_choice/acc_norm", "words_generate/exact_match")
    for record in logged:
        offline = evaluate(MegatronLiteLM(load=str(tmp_path / "run"), iteration=record["iteration"]), None, task_dir,
                           tasks, limit=4)
        for name in names:
            task, metric = name.split("/")
            assert record[f"downstream/{name}"] == pytest.approx(offline["results"][task][f"{metric},none"]), name
            scalars = {event.step: event.value for event in events.Scalars(f"downstream/{name}")}
            assert scalars[record["iteration"]] == pytest.approx(record[f"downstream/{name}"], rel=1e-6), name
    assert [json.loads(r["downstream/words_choice/acc"]) for r in in_wandb[:2]] == pytest.approx(
        [record["downstream/words_choice/acc"] for record in logged[:2]])
    convert("--direction", "mlite-to-hf", "--load-dir", str(tmp_path / "run"), "--iteration", "6", "--save-dir",
            str(tmp_path / "hf6"))
    PreTrainedTokenizerFast = __import__("transformers").PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=word_level_tokenizer(), eos_token="</s>").save_pretrained(tmp_path / "hf6")
    _compare(offline, evaluate("hf", f"pretrained={tmp_path / 'hf6'},dtype=float32,device=cpu", task_dir, tasks,
                               limit=4), tasks)


def test_eval_tasks_that_cannot_run_are_one_line_before_training(models_and_tasks, tmp_path):
    from megatron_lite.config.arguments import make_config
    from megatron_lite.errors import ConfigError
    from megatron_lite.evaluation.in_training import DownstreamEvaluation

    base = {"model_preset": "llama-tiny", "mock_data": True, "train_iters": 1}
    with pytest.raises(ConfigError, match="--eval-tasks scores text: give the run's tokenizer"):
        DownstreamEvaluation(make_config({**base, "eval_tasks": ["words_choice"]}))
    with pytest.raises(ConfigError, match="lm-eval knows no task 'no_such_task'"):
        DownstreamEvaluation(make_config({**base, "eval_tasks": ["no_such_task"], "tokenizer_type":
                                          "SentencePieceTokenizer", "tokenizer_model": "unused.model"}))
    _, _, task_dir = models_and_tasks  # a task of your own whose documents are not where it says
    task = (Path(task_dir) / "words_choice.yaml").read_text().replace("task: words_choice", "task: no_data")
    (tmp_path / "no_data.yaml").write_text(task.replace(str(Path(task_dir) / "words_choice.jsonl"),
                                                        str(tmp_path / "absent.jsonl")))
    with pytest.raises(ConfigError, match=r"--eval-tasks: task 'no_data' cannot load its documents: .*absent.jsonl"):
        DownstreamEvaluation(make_config({**base, "eval_tasks": [str(tmp_path / "no_data.yaml")], "tokenizer_type":
                                          "SentencePieceTokenizer", "tokenizer_model": "unused.model"}))


def test_the_shipped_shakespeare_tasks_score_offline_as_the_hf_model(models_and_tasks):
    """The project's own tasks (megatron_lite/evaluation/tasks: a cloze and a next-word generation drawn from
    the public-domain demo corpus) load with no download and score as lm-eval's hf model does."""
    from megatron_lite.evaluation.harness_model import MegatronLiteLM

    hf_dir, mlite_dir, _ = models_and_tasks
    shipped = str(Path(__file__).resolve().parents[1] / "megatron_lite" / "evaluation" / "tasks")
    tasks = ("shakespeare_cloze", "shakespeare_next_word")
    ours = evaluate(MegatronLiteLM(load=mlite_dir, batch_size=4), None, shipped, tasks, limit=8)
    theirs = evaluate("hf", f"pretrained={hf_dir},dtype=float32,device=cpu", shipped, tasks, limit=8)
    _compare(ours, theirs, tasks)
    assert theirs["results"]["shakespeare_next_word"]["exact_match,first_word"] is not None
