"""lm-evaluation-harness's command line with the `megatron_lite` model registered: score a checkpoint as it is.

    python tools/run_lm_eval.py --model megatron_lite --model_args load=checkpoints/run1 --tasks arc_easy,hellaswag
    python tools/run_lm_eval.py --model megatron_lite --model_args load=ckpt/gpt,batch_size=16 \\
        --include_path my_tasks --tasks my_task --limit 100 --log_samples --output_path results/

Every lm_eval flag works as it does there (`lm_eval --help`); --model_args takes load= (a --save directory or one
iteration of it), iteration=, tokenizer_type= and tokenizer_model= (when the checkpoint carries no tokenizer),
batch_size= and device=. Datasets are downloaded only if a task needs one that is not local (HF_DATASETS_OFFLINE=1
keeps it offline).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        sys.exit('run_lm_eval.py: error: lm-evaluation-harness is not installed; pip install -e ".[eval]"')
    import megatron_lite.evaluation.harness_model  # noqa: F401  (registers the megatron_lite model)

    cli_evaluate()


if __name__ == "__main__":
    main()
