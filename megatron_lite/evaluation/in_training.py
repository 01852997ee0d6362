"""Downstream accuracy during training (--eval-tasks): lm-evaluation-harness on the live model at each evaluation.

pretrain_gpt.py hands a `DownstreamEvaluation` to the loop as Megatron's `non_loss_data_func`: every
--eval-interval iterations, beside the validation loss, the harness's `megatron_lite` model wraps the model
being trained (no checkpoint is written or read: harness_model.MegatronLiteLM.around) and scores the first
--eval-task-limit documents of each task, with the run's tokenizer and --seq-length as the context length.
Every rank of the run takes part (data-parallel replicas split the requests as under tools/run_lm_eval.py);
the scores come back from rank 0 to every rank, for the logger. The cost is the forward passes of the subset's
requests (and the generated tokens of generation tasks), nothing else.

Everything that can be wrong is found when the run starts, before any compute: lm-eval not installed, a task
it does not know, a task file that names no task, a run without a text tokenizer, context parallelism (its
sequence split is not applied to the harness's batches).
"""

from __future__ import annotations

import os

import torch.distributed as dist
import yaml

from megatron_lite.config.sections import Config
from megatron_lite.data.tokenizers import build_tokenizer
from megatron_lite.errors import ConfigError
from megatron_lite.evaluation.model_runner import ModelRunner


class _TaskFileLoader(yaml.SafeLoader):
    """Reads a task file's plain keys; lm-eval's own tags (`!function module.name`) are left unresolved here."""


_TaskFileLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _task_names_and_folders(entries: list[str]) -> tuple[list[str], list[str]]:
    """Task names: each entry itself, or the task a YAML file names (its folder joins the include path)."""
    names, folders = [], []
    for entry in entries:
        if not entry.endswith((".yaml", ".yml")):
            names.append(entry)
            continue
        if not os.path.isfile(entry):
            raise ConfigError(f"--eval-tasks {entry}: no such task file")
        try:
            with open(entry, encoding="utf-8") as f:
                task = (yaml.load(f, Loader=_TaskFileLoader) or {}).get("task")
        except (yaml.YAMLError, AttributeError) as error:
            raise ConfigError(f"--eval-tasks {entry}: not a task file ({str(error).splitlines()[0]})") from None
        if not isinstance(task, str):
            raise ConfigError(f"--eval-tasks {entry}: the file names no task (its 'task:' key)")
        names.append(task)
        folders.append(os.path.dirname(os.path.abspath(entry)))
    return names, sorted(set(folders))


def _scalar_name(task: str, key: str) -> str:
    """`task/metric` for lm-eval's result key `metric,filter` (`task/metric_filter` under a filter of the task's)."""
    metric, filter_name = key.split(",", 1)
    return f"{task}/{metric}" if filter_name == "none" else f"{task}/{metric}_{filter_name}"


def _check_task_data(tasks: list[str], task_manager) -> None:
    """Load each task once, its documents included, so that a task whose data is missing or unreadable stops the
    run in one line before any step instead of at its first evaluation."""
    from lm_eval.tasks import get_task_dict

    for task in tasks:
        try:
            get_task_dict([task], task_manager)
        except (OSError, ValueError) as error:  # a missing file, a dataset that is not here offline
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(f"--eval-tasks: task {task!r} cannot load its documents: {message}") from None


class DownstreamEvaluation:
    """Scores --eval-tasks on the training model: `evaluation(model, pstate, device)` -> {task/metric: value}."""

    def __init__(self, config: Config):
        try:
            from lm_eval.tasks import TaskManager
        except ImportError:
            raise ConfigError('--eval-tasks needs lm-evaluation-harness: pip install -e ".[eval]"') from None
        if config.parallel.context_parallel_size > 1:
            raise ConfigError("--eval-tasks does not run under --context-parallel-size > 1 yet; evaluate "
                              "checkpoints with tools/run_lm_eval.py instead")
        data = config.data
        if data.tokenizer_type == "NullTokenizer" or not data.tokenizer_model:
            raise ConfigError("--eval-tasks scores text: give the run's tokenizer (--tokenizer-type and "
                              "--tokenizer-model)")
        self.config = config
        self.tasks, folders = _task_names_and_folders(config.training.eval_tasks)
        named = any(not entry.endswith((".yaml", ".yml")) for entry in config.training.eval_tasks)
        # lm-eval's own task index takes seconds to build: only when a task is named rather than given as a file
        self.task_manager = TaskManager(include_path=folders or None, include_defaults=named)
        unknown = [task for task in self.tasks if task not in self.task_manager.all_tasks]
        if unknown:
            raise ConfigError(f"--eval-tasks: lm-eval knows no task {unknown[0]!r} (lm_eval ls tasks lists them; a "
                              f"task of your own is a YAML file, given by its path)")
        _check_task_data(self.tasks, self.task_manager)
        self.tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, config.model.vocab_size)

    def __call__(self, model: list, pstate, device) -> dict[str, float]:
        import lm_eval

        from megatron_lite.evaluation.harness_model import MegatronLiteLM

        c = self.config
        runner = ModelRunner(c, pstate, device, model, c.model.seq_length, c.training.micro_batch_size,
                             c.model.vocab_size)
        for chunk in model:
            chunk.eval()
        try:
            results = lm_eval.simple_evaluate(model=MegatronLiteLM.around(runner, self.tokenizer), tasks=self.tasks,
                                              limit=c.training.eval_task_limit, task_manager=self.task_manager,
                                              bootstrap_iters=0, verbosity="WARNING")
        finally:
            for chunk in model:
                chunk.train()
        scores = None
        if results is not None:
            scores = {_scalar_name(task, key): float(value) for task, metrics in results["results"].items()
                      for key, value in metrics.items()
                      if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
        if dist.is_initialized() and dist.get_world_size() > 1:
            holder = [scores]
            dist.broadcast_object_list(holder, src=0)
            scores = holder[0]
        return scores
