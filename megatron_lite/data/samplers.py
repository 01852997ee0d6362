"""Which samples each data-parallel rank reads: a function of consumed samples only, so runs resume exactly.

The global batch that follows c consumed samples covers samples [c, c + B) of the (already shuffled)
dataset, where B is the global batch size (growing with c under --rampup-batch-size). Each step of
micro-batches takes the next micro_batch_size x dp samples, and data-parallel rank r reads the r-th slice
of micro_batch_size, as Megatron's MegatronPretrainingSampler does; a global batch is B / (micro_batch_size
x dp) such steps, so the stream of micro-batches is the same whatever B is. Resuming at consumed_samples = k
continues with sample k whatever the data-parallel size was before.
"""

from __future__ import annotations


class PretrainingSampler:
    """Yields lists of sample indices, one list per micro-batch of this data-parallel rank."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed samples ({consumed_samples}) must be below the dataset size "
                             f"({total_samples}); the dataset was built for fewer iterations")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.rank = data_parallel_rank
        self.step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.step

    def __iter__(self):
        start = self.consumed_samples
        while start + self.step <= self.total_samples:
            first = start + self.rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += self.step


def rampup_global_batch_size(consumed_samples: int, start: int, increment: int, rampup_samples: int,
                             global_batch_size: int) -> int:
    """The global batch of the step that begins after `consumed_samples`, under Megatron's
    --rampup-batch-size START INCREMENT SAMPLES: the batch grows from START by INCREMENT in
    (global_batch_size - START) / INCREMENT equal intervals of SAMPLES samples in all, and is
    global_batch_size from SAMPLES consumed samples on. It depends on the consumed samples alone, so a
    resumed run reads the same batches as one that never stopped.
    """
    increments = (global_batch_size - start) // increment
    if consumed_samples >= rampup_samples or increments == 0:
        return global_batch_size
    return start + consumed_samples * increments // rampup_samples * increment


def iterations_in_samples(train_samples: int, global_batch_size: int, global_batch_size_at) -> int:
    """How many whole global batches fit in `train_samples` when the step after c consumed samples takes
    `global_batch_size_at(c)` of them, which reaches `global_batch_size` after any ramp-up (a last, partial
    batch is dropped, as in Megatron)."""
    iterations = consumed = 0
    while (batch := global_batch_size_at(consumed)) < global_batch_size and consumed + batch <= train_samples:
        consumed += batch
        iterations += 1
    return iterations + (train_samples - consumed) // global_batch_size
