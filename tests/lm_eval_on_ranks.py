"""lm-eval's simple_evaluate with the megatron_lite model on several ranks, for tests/test_lm_eval.py (which runs
`main` on forked ranks with torchrun's variables), or as users run it:

    torchrun --nproc-per-node 2 tests/lm_eval_on_ranks.py OUT CHECKPOINT TASK_DIR TP PP TASK...

The process that lm-eval returns results on (data-parallel rank 0, local rank 0) saves them to OUT. Only the tasks
of TASK_DIR are indexed (lm-eval's own thousands of task files cost each rank seconds).
"""

from __future__ import annotations

import sys

import torch


def main(argv: list[str] | None = None) -> int:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megatron_lite.evaluation.harness_model import MegatronLiteLM

    out, checkpoint, task_dir, tp, pp, *tasks = sys.argv[1:] if argv is None else argv
    model = MegatronLiteLM(load=checkpoint, batch_size=4, tensor_model_parallel_size=tp,
                           pipeline_model_parallel_size=pp)
    results = lm_eval.simple_evaluate(model=model, tasks=tasks, log_samples=True, bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=task_dir, include_defaults=False))
    if results is not None:
        torch.save({"results": results["results"], "samples": results["samples"]}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
