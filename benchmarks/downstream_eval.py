"""What --eval-tasks costs a training run, against what the harness's own forward passes of the same requests cost.

Two runs of the whole `pretrain_gpt.py` (one process, mock data, a word-level tokenizer, llama-tiny), the
same but for `--eval-tasks` (tests/test_lm_eval.py's multiple-choice and generation tasks of local documents,
`--eval-task-limit` documents each, every `--eval-interval` iterations), alternated `--repeats` times in the
same session so that machine load hits both alike. The peer is lm-evaluation-harness with the
`megatron_lite` model scoring the same subset on the checkpoint the run saved, the model already loaded (the
forward passes and the harness's own request handling, nothing else). A third run sets the tasks up and
never evaluates (--eval-interval past the end): the one-time cost of importing lm-eval and reading the tasks.
Each evaluation's cost is the rest, over the evaluations; a ratio near 1 to the harness's says an evaluation
pays for the requests' forward passes and nothing more.

    python -m benchmarks.downstream_eval [--repeats 2] [--limit 10]
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
from tests.helpers import HF_VOCAB

ROOT = Path(__file__).resolve().parents[1]
ITERS, INTERVAL = 40, 10
TASKS = ("words_choice", "words_generate")  # tests/test_lm_eval.py's local tasks


def prepare(root: Path) -> tuple[Path, list[Path]]:
    """A word-level tokenizer folder and the task files."""
    from transformers import PreTrainedTokenizerFast

    from tests.helpers import word_level_tokenizer
    from tests.test_lm_eval import TASKS as TEMPLATES
    from tests.test_lm_eval import _documents

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level_tokenizer(), eos_token="</s>")
    tokenizer.save_pretrained(root / "tokenizer")
    rng = random.Random(0)
    tasks = []
    for name in TASKS:
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(document) + "\n" for document in _documents(name, rng)))
        (root / f"{name}.yaml").write_text(TEMPLATES[name].format(path=data))
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
    parser.add_argument("--limit", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        tokenizer, tasks = prepare(root)
        common = ["--model-preset", "llama-tiny", "--num-layers", "2", "--vocab-size", str(HF_VOCAB),
                  "--seq-length", "64", "--max-position-embeddings", "64", "--mock-data",
                  "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tokenizer),
                  "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", str(ITERS),
                  "--eval-interval", str(INTERVAL), "--eval-iters", "1", "--log-interval", str(ITERS),
                  "--device", "cpu"]
        plain, started, with_tasks = [], [], []
        eval_tasks = ["--eval-tasks", *map(str, tasks), "--eval-task-limit", str(args.limit)]
        for repeat in range(args.repeats):
            plain.append(run(common))
            started.append(run([*common, *eval_tasks, "--eval-interval", str(10 * ITERS)]))  # set up, never run
            save = root / f"run{repeat}"
            with_tasks.append(run([*common, *eval_tasks, "--save", str(save)]))
        harness = harness_seconds(save, tasks, args.limit)
    evaluations = ITERS // INTERVAL
    median = statistics.median
    per_evaluation = (median(with_tasks) - median(started)) / evaluations
    figures = {"train_iters": ITERS, "evaluations": evaluations, "documents_per_task": args.limit,
               "run_s_without": round(median(plain), 2), "run_s_with": round(median(with_tasks), 2),
               "setup_s": round(median(started) - median(plain), 2), "per_evaluation_s": round(per_evaluation, 2),
               "harness_s_per_evaluation": round(harness, 2), "per_evaluation_over_harness": round(
                   per_evaluation / harness, 3)}
    print(json.dumps(figures, indent=1))
    record_result("downstream_eval", figures, sys.argv)


if __name__ == "__main__":
    main()
