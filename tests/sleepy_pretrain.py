"""pretrain_gpt.py with test-only delays: the subject of the hang report's and the replica groups' tests.

SLEEP_RANK sleeps SLEEP_SECONDS in its first forward of iteration SLEEP_ITERATION (1-based, as logged); with
PACE_SECONDS every forward sleeps that long first (a step rate the test can count on whatever the machine's
load); with SAVE_SECONDS every checkpoint save takes that long more; without any this is pretrain_gpt.py
itself."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_gpt  # noqa: E402
from megatron_lite.checkpoint.checkpointing import Checkpointer  # noqa: E402
from megatron_lite.parallel.progress import RECORD  # noqa: E402

plain_forward_step = pretrain_gpt.forward_step
plain_save_checkpoint = Checkpointer.save_checkpoint


def forward_step(data_iterator, model):
    time.sleep(float(os.environ.get("PACE_SECONDS", "0")))
    if (os.environ.get("SLEEP_RANK") == os.environ["RANK"]
            and RECORD.iteration == int(os.environ["SLEEP_ITERATION"])):
        time.sleep(float(os.environ.get("SLEEP_SECONDS", "600")))
    return plain_forward_step(data_iterator, model)


def save_checkpoint(self, *args, **kwargs):
    time.sleep(float(os.environ.get("SAVE_SECONDS", "0")))
    return plain_save_checkpoint(self, *args, **kwargs)


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    pretrain_gpt.forward_step = forward_step
    Checkpointer.save_checkpoint = save_checkpoint
    return pretrain_gpt.main(argv, own_process)


if __name__ == "__main__":
    sys.exit(main(own_process=True))
