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
    """Writes `save(part)` calls (dicts of global name -> whole tensor), `save_boxes(part)` and `save_objects(part)`
    calls into one DCP directory; `close` writes its index. A box of a tensor may appear in one part only."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1)
        self.parts = 0
        self._entries: dict = {}  # Metadata.state_dict_metadata of every part so far
        self._offsets: dict[str, set] = {}  # the global offsets of the boxes written so far, per tensor
        self._results: list = []  # the WriteResults (where each chunk's bytes are) of every part so far
        self._flusher = ThreadPoolExecutor(max_workers=1)
        self._flushes = []

    def save(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write one part, whole tensors under their global names; the caller may drop them afterwards."""
        self.save_boxes([ShardedTensor.whole(name, tensor.contiguous()) for name, tensor in tensors.items()])

    def save_boxes(self, pieces: list[ShardedTensor]) -> None:
        """Write one part given as boxes of global tensors: a tensor may be written a box per part (a layer of
        a tensor stacking the layers on a leading axis), each box once."""
        boxes = {(piece.key, tuple(piece.global_offset)) for piece in pieces}
        repeated = sorted(key for key, offset in boxes if offset in self._offsets.get(key, ()))
        if repeated or len(boxes) < len(pieces):
            raise ValueError(f"a box of '{repeated[0] if repeated else pieces[0].key}' is in two parts of {self.path}")
        pieces = [dataclasses.replace(piece, data=piece.data.contiguous()) for piece in pieces]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state_dict_of(pieces), planner=ShardedSavePlanner(pieces), storage_writer=self, no_dist=True)
        for key, offset in boxes:
            self._offsets.setdefault(key, set()).add(offset)
        for name in sorted({result.storage_data.relative_path for result in self._results[-1]}):
            self._flushes.append(self._flusher.submit(directory.fsync, os.path.join(self.path, name)))
        self.parts += 1

    def save_objects(self, objects: dict) -> None:
        """Write one part of plain values under their keys (DCP's byte entries: each a torch.save record)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(dict(objects), storage_writer=self, no_dist=True)
        self.parts += 1

    def prepare_global_plan(self, plans):
        plans = super().prepare_global_plan(plans)
        return [dataclasses.replace(plan, storage_data=dataclasses.replace(plan.storage_data,
                                                                           prefix=f"__{self.parts}_"))
                for plan in plans]

    def finish(self, metadata: Metadata, results) -> None:
        """The end of one part's save: its entries are kept for the index that `close` writes (the chunks of a
        tensor written over several parts joined)."""
        for key, entry in metadata.state_dict_metadata.items():
            if key in self._entries:
                self._entries[key].chunks.extend(entry.chunks)
            else:
                self._entries[key] = entry
        self._results += results

    def close(self) -> None:
        """Wait until every part's file is on disk, then write `.metadata`, the index of every part, as one save
        would (flushed too)."""
        self._flusher.shutdown(wait=True)
        for flush in self._flushes:
            flush.result()  # an I/O error of a flush is raised here
        self.sync_files = True
        super().finish(Metadata(state_dict_metadata=dict(self._entries)), self._results)
