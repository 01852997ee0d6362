"""A torch.distributed.checkpoint directory written a part at a time, so that a conversion never holds a
whole model.

`dcp.save` takes the whole state dict at once. A DCP directory, though, is data files plus one `.metadata`
index (a pickled Metadata: every tensor's global shape and chunks, and for each chunk the file, offset and
length of its bytes), and nothing in it ties a data file to the save call that wrote it. So `PartsWriter`
makes one ordinary `dcp.save` per part (a layer, a vocabulary table) through a FileSystemWriter that

  * names the data file of part p as a save by several ranks names rank p's, `__{p}_0.distcp`, and
  * keeps each call's index entries instead of writing `.metadata`; `close` writes the merged index once,
    with FileSystemWriter's own `finish`.

Each part's file is written without waiting for the disk and flushed (fsync) by a background thread while
the next part is converted; it holds no tensor, only the file's name, so the disk works during the
conversion at no cost in memory. `close` waits for every flush before it writes the index, so the checkpoint
is as durable, when committed, as one save makes it.

The result is the directory a single save by as many ranks as there are parts writes: DCP serialized every
byte (tensors as torch.save records, read back with weights_only=True), and every loader here, resharding
included, reads it as it reads a training checkpoint. Rejected: writing `.distcp` files and pickling a
Metadata ourselves (a second implementation of DCP's format to keep in step with torch), and one directory
per part (not one checkpoint).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, Metadata

from megatron_lite.checkpoint import directory
from megatron_lite.checkpoint.planner import ShardedSavePlanner, state_dict_of
from megatron_lite.checkpoint.sharded import ShardedTensor


class PartsWriter(FileSystemWriter):
    """Writes `save(part)` calls (dicts of global name -> whole tensor) into one DCP directory; `close` writes
    its index. A name may appear in one part only."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1)
        self.parts = 0
        self._entries: dict = {}  # Metadata.state_dict_metadata of every part so far
        self._results: list = []  # the WriteResults (where each chunk's bytes are) of every part so far
        self._flusher = ThreadPoolExecutor(max_workers=1)
        self._flushes = []

    def save(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write one part, whole tensors under their global names; the caller may drop them afterwards."""
        repeated = sorted(tensors.keys() & self._entries.keys())
        if repeated:
            raise ValueError(f"'{repeated[0]}' is in two parts of {self.path}")
        pieces = [ShardedTensor.whole(name, tensor.contiguous()) for name, tensor in tensors.items()]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state_dict_of(pieces), planner=ShardedSavePlanner(pieces), storage_writer=self, no_dist=True)
        for name in sorted({result.storage_data.relative_path for result in self._results[-1]}):
            self._flushes.append(self._flusher.submit(directory.fsync, os.path.join(self.path, name)))
        self.parts += 1

    def prepare_global_plan(self, plans):
        plans = super().prepare_global_plan(plans)
        return [dataclasses.replace(plan, storage_data=dataclasses.replace(plan.storage_data,
                                                                           prefix=f"__{self.parts}_"))
                for plan in plans]

    def finish(self, metadata: Metadata, results) -> None:
        """The end of one part's save: its entries are kept for the index that `close` writes."""
        self._entries.update(metadata.state_dict_metadata)
        self._results += results

    def close(self) -> None:
        """Wait until every part's file is on disk, then write `.metadata`, the index of every part, as one save
        would (flushed too)."""
        self._flusher.shutdown(wait=True)
        for flush in self._flushes:
            flush.result()  # an I/O error of a flush is raised here
        self.sync_files = True
        super().finish(Metadata(state_dict_metadata=dict(self._entries)), self._results)
