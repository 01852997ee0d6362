"""The training path runs on a plain CUDA image: without datasets, wandb, sentencepiece or tensorboard.

GPU images commonly carry torch and a few small libraries but not these (the H200 image here lacks all but
sentencepiece), and nothing can be installed there. They are imported only inside the functions that need
them, so a mock-data run never touches them.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("datasets", "wandb", "sentencepiece", "tensorboard")

# Runs in a fresh interpreter, where none of BLOCKED has been imported yet.
SCRIPT = f"""
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
import megatron_lite.training.loop
import pretrain_gpt

sys.exit(pretrain_gpt.main([
    "--model-preset", "llama-tiny", "--mock-data", "--device", "cpu", "--num-layers", "2", "--hidden-size", "32",
    "--ffn-hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "128",
    "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "2", "--log-interval", "1", "--eval-interval", "2",
    "--eval-iters", "1"]))
"""


def test_mock_data_pretraining_runs_without_optional_packages():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " iteration      2/2 |" in result.stdout
    assert " validation at iteration 2 |" in result.stdout
