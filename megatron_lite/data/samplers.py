"""Which samples each data-parallel rank reads: a function of consumed samples only, so runs resume exactly.

Global batch number g covers samples [g * gbs, (g + 1) * gbs) of the (already shuffled) dataset. Each
step of micro-batches takes the next micro_batch_size x dp samples, and data-parallel rank r reads the
r-th slice of micro_batch_size, as Megatron's MegatronPretrainingSampler does. Resuming at
consumed_samples = k continues with sample k whatever the data-parallel size was before.
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
