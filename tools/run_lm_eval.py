"""lm-evaluation-harness's command line with the `megatron_lite` model registered: score a checkpoint as it is.

    python tools/run_lm_eval.py --model megatron_lite --model_args load=checkpoints/run1 --tasks arc_easy,hellaswag
    python tools/run_lm_eval.py --model megatron_lite --model_args load=ckpt/gpt,batch_size=16 \\
        --include_path my_tasks --tasks my_task --limit 100 --log_samples --output_path results/

Every lm_eval flag works as it does there (`lm_eval --help`); --model_args takes load= (a --save directory or one
iteration of it), iteration=, tokenizer_type= and tokenizer_model= (when the checkpoint carries no tokenizer),
batch_size= and device=. Datasets are downloaded only if a task needs one that is not local (HF_DATASETS_OFFLINE=1
keeps it offline). A mistake (an unknown task, a task whose data is not here, a checkpoint without a tokenizer)
is one line; MEGATRON_LITE_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    try:
        from lm_eval._cli import HarnessCLI
    except ImportError:
        sys.exit('run_lm_eval.py: error: lm-evaluation-harness is not installed; pip install -e ".[eval]"')
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["--help"], ["-h"]):  # the flags of an evaluation (lm-eval's run command), not its commands
        argv = ["run", "--help"]
    parser = HarnessCLI()
    saved, sys.argv = sys.argv, [sys.argv[0], *argv]  # lm-eval's parser reads sys.argv
    try:
        args = parser.parse_args()  # --help and a mistake in a flag are answered here, before torch is imported
    finally:
        sys.argv = saved
    from lm_eval.utils import setup_logging

    import megatron_lite.evaluation.harness_model  # noqa: F401  (registers the megatron_lite model)
    from megatron_lite.errors import UserError, debug_requested

    setup_logging()
    try:
        parser.execute(args)
    except (UserError, ValueError, OSError) as error:  # an unknown task, a task whose data is not here, a checkpoint
        if debug_requested():
            raise
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        sys.exit(f"run_lm_eval.py: error: {message}")


if __name__ == "__main__":
    main()
