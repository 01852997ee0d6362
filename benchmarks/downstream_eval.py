"""What --eval-tasks costs a training run, against what the harness's own forward passes of the same requests cost.

Two runs of the whole `pretrain_gpt.py` (one process, mock data, a word-level tokenizer, llama-tiny), the same
but for `--eval-tasks` (a multiple-choice and a generation task of local documents, `--eval-task-limit`
documents each, every `--eval-interval` iterations), alternated `--repeats` times in the same session so that
machine load hits both alike. The peer is lm-evaluation-harness with the `megatron_lite` model scoring the same
subset on the checkpoint the run saved, the model already loaded (the forward passes and the harness's own
request handling, nothing else), times the number of evaluations. A ratio near 1 says the run pays for the
requests' forward passes and nothing more.

    python -m benchmarks.downstream_eval [--repeats 2] [--limit 40]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results_file import record_result

ROOT = Path(__file__).resolve().parents[1]
VOCAB, ITERS, INTERVAL = 300, 40, 10
CHOICE = """task: bench_choice
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
"""
GENERATE = """task: bench_generate
dataset_path: json
dataset_kwargs:
  data_files: {data}
test_split: train
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["w7"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(1, VOCAB - 1)}" for _ in range(n))


def prepare(root: Path) -> tuple[Path, list[Path]]:
    """A word-level tokenizer folder and the two task files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"</s>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>").save_pretrained(root / "tokenizer")
    rng = random.Random(0)
    tasks = []
    for name, template, document in (
            ("bench_choice", CHOICE, lambda: {"context": _words(rng, 12), "choices": [_words(rng, 2) for _ in range(4)],
                                              "gold": rng.randrange(4)}),
            ("bench_generate", GENERATE, lambda: {"context": _words(rng, 12), "answer": _words(rng, 2)})):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(document()) + "\n" for _ in range(200)))
        (root / f"{name}.yaml").write_text(template.format(data=data))
        tasks.append(root / f"{name}.yaml")
    return root / "tokenizer", tasks


def run(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1"}, cwd=ROOT)
    return time.perf_counter() - start


def harness_seconds(save: Path, tasks: list[Path], limit: int) -> float:
    """The harness scoring the subset on the saved checkpoint, the model loaded before the clock starts."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megatron_lite.evaluation.harness_model import MegatronLiteLM

    model = MegatronLiteLM(load=str(save), batch_size=2)
    manager = TaskManager(include_path=str(tasks[0].parent))
    start = time.perf_counter()
    lm_eval.simple_evaluate(model=model, tasks=[t.stem for t in tasks], limit=limit, task_manager=manager,
                            bootstrap_iters=0, verbosity="ERROR")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--limit", type=int, default=40)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        tokenizer, tasks = prepare(root)
        common = ["--model-preset", "llama-tiny", "--num-layers", "2", "--vocab-size", str(VOCAB), "--seq-length", "64",
                  "--max-position-embeddings", "64", "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer",
                  "--tokenizer-model", str(tokenizer), "--micro-batch-size", "2", "--global-batch-size", "2",
                  "--train-iters", str(ITERS), "--eval-interval", str(INTERVAL), "--eval-iters", "1",
                  "--log-interval", str(ITERS), "--device", "cpu"]
        plain, with_tasks = [], []
        for repeat in range(args.repeats):
            plain.append(run(common))
            save = root / f"run{repeat}"
            with_tasks.append(run([*common, "--eval-tasks", *map(str, tasks), "--eval-task-limit", str(args.limit),
                                   "--save", str(save)]))
        harness = harness_seconds(save, tasks, args.limit)
    evaluations = ITERS // INTERVAL
    extra = statistics.median(with_tasks) - statistics.median(plain)
    figures = {"train_iters": ITERS, "evaluations": evaluations, "documents_per_task": args.limit,
               "run_s_without": round(statistics.median(plain), 2),
               "run_s_with": round(statistics.median(with_tasks), 2),
               "extra_s": round(extra, 2), "harness_s_per_evaluation": round(harness, 2),
               "extra_over_harness": round(extra / (evaluations * harness), 3)}
    print(json.dumps(figures, indent=1))
    record_result("downstream_eval", figures, sys.argv)


if __name__ == "__main__":
    main()
