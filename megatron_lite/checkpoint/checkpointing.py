"""Save and load training checkpoints: sharded, layout-independent, synchronous or asynchronous.

What a checkpoint holds (torch.distributed.checkpoint under global keys, see checkpoint/sharded.py):
  model       `<global name>` for every parameter: global layer index, unpadded vocabulary
  optimizer   `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<global name>`, Muon's `momentum_buffer` in
              place of Adam's moments for hidden matrices (--optimizer muon; loaded only by the same optimizer)
  RNG         `rng_state.<layout>.rank_<r>.<generator>`: per rank, only restored in the same layout
and `metadata.json`: iteration, consumed samples, the optimizer's step count and loss-scaler state, layout,
configuration, versions. The learning rate is a function of the iteration and needs no state. Model and
optimizer describe what they hold with the FlatShard protocol (optim/distributed_optimizer.py: a flat
range of a parameter's TP shard, whole for the plain optimizer, 1/d of it under ZeRO), which becomes boxes
of the global tensors. Every rank writes only the boxes it holds, in parallel; boxes held by several ranks
(data-parallel replicas, the last stage's copy of tied embeddings) are written once. A data loader
position handed to `save_checkpoint` (a raw-text stream's, data/raw_text.py) goes in metadata.json too, and
a load returns it in the ResumeState.

Each rank records the size and CRC-32 of the files it wrote; the coordinator commits only when every
file is there (checkpoint/checksums.py) and stores the records in `metadata.json`. A load verifies them,
spread over the ranks, before reading any tensor, and every stored model tensor must be loaded by some
rank: a checkpoint of a bigger model is an error, not a partial load. The iteration loaded is the newest
complete one, or `--ckpt-step N`; a tracker file naming a missing iteration is an error
(checkpoint/directory.py). A run holds `--save` exclusively from start-up to close, after checking that
every rank can write there (checkpoint/save_lock.py). Problems that only some ranks can see are agreed
over the checkpoint group first (checkpoint/agreement.py), so every rank stops with the same one-line
error and none waits in a collective.

An asynchronous save copies the boxes this rank writes to CPU memory (the only time training waits; the
buffers are kept for the next save, so later copies cost no page faults), then writes and checksums them
from a background thread over a process group of its own, so the training loop's collectives never
interleave with the save's. The next save, or the end of the run, waits for it; the coordinator commits
it (checkpoint/directory.py) as soon as every rank has written.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import platform
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from megatron_lite.checkpoint import checksums, directory
from megatron_lite.checkpoint.agreement import agree, all_gather, decided_by_coordinator, rank_and_size
from megatron_lite.checkpoint.load_path import load_problem
from megatron_lite.checkpoint.rng_state import layout_tag, rng_states, set_rng_states
from megatron_lite.checkpoint.save_lock import SaveLock, unwritable
from megatron_lite.checkpoint.sharded import ShardedTensor, shard_boxes
from megatron_lite.config.sections import Config
from megatron_lite.errors import CheckpointError
from megatron_lite.model.sharding import FlatShard
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState

FORMAT = "megatron_lite/dcp/1"
_UNDECIDED = object()


def _dcp():
    """torch.distributed.checkpoint and this package's planners over it, imported at the first save or load: they
    import DTensor and sympy, about a second of a process's start-up that a run without checkpoints never uses."""
    import torch.distributed.checkpoint as dcp

    from megatron_lite.checkpoint import planner

    return dcp, planner


def to_boxes(state: dict, pstate: ParallelState) -> tuple[list[ShardedTensor], dict]:
    """Split a FlatShard-protocol state into boxes of global tensors and the plain values it also holds."""
    pieces, values = [], {}
    for key, value in state.items():
        if isinstance(value, FlatShard):
            pieces += shard_boxes(key, value.spec, *pstate.tensor_split.of(value.spec), value.data, value.flat_range)
        else:
            values[key] = value
    return pieces, values


def model_sharded_state_dict(model: list, pstate: ParallelState) -> list[ShardedTensor]:
    """This rank's boxes of every parameter (under ZeRO-3, of the parameter shards it keeps) and checkpointed
    buffer."""
    state = {}
    for chunk in model:
        if hasattr(chunk, "sharded_parameters"):
            state.update(chunk.sharded_parameters())
        else:
            state.update({name: FlatShard(p.detach().view(-1), p.spec, (0, p.numel()))
                          for name, p in chunk.named_global_parameters()})
        state.update({name: FlatShard(b.view(-1), b.spec, (0, b.numel())) for name, b in chunk.named_global_buffers()})
    return to_boxes(state, pstate)[0]


@dataclasses.dataclass
class ResumeState:
    """Where a run continues: the iteration and data position (with the loader's own position where its
    samples do not follow from consumed_samples alone), and generator states to restore once everything
    that draws at start-up (data loaders) has been built."""

    iteration: int = 0
    consumed_samples: int = 0
    rng: dict[str, torch.Tensor] | None = None
    loader_state: dict | None = None

    def restore_rng(self, model: list, device: torch.device) -> None:
        if self.rng is not None:
            set_rng_states(model, device, self.rng)


def rng_pieces(tag: str, rank: int, states: dict[str, torch.Tensor]) -> list[ShardedTensor]:
    """This rank's generator states under keys of their own: they are per rank and per layout."""
    return [ShardedTensor.whole(f"rng_state.{tag}.rank_{rank}.{name}", state) for name, state in states.items()]


def _versions() -> dict:
    try:
        package = importlib.metadata.version("megatron-lite")
    except importlib.metadata.PackageNotFoundError:
        package = "unknown"
    return {"megatron_lite": package, "torch": torch.__version__, "python": platform.python_version()}


def stored_bytes(metadata) -> int:
    """Bytes a DCP checkpoint with this metadata holds on disk."""
    return sum(info.length for info in metadata.storage_data.values())


class Checkpointer:
    """Saves and loads the checkpoints of one run, for every rank (all methods are collective)."""

    def __init__(self, config: Config, pstate: ParallelState, device: torch.device):
        self.config = config
        self.pstate = pstate
        self.device = device
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        # A group of its own (gloo: the staged tensors live in CPU memory) so that a background save never
        # interleaves its collectives with the training loop's.
        self.group = dist.new_group(backend="gloo", timeout=pstate.timeout) if self.distributed else None
        self.is_coordinator = pstate.rank == 0
        self.executor = ThreadPoolExecutor(max_workers=1) if config.checkpoint.async_save else None
        self.pending: Future | None = None
        self.last_saved_iteration: int | None = None
        self.staging: dict[tuple, torch.Tensor] = {}  # CPU copies of the last async save, reused
        self._iteration_to_load = _UNDECIDED
        if config.checkpoint.load:
            agree(load_problem(config.checkpoint.load), self.group)
        self.save_lock = self._claim_save_directory() if config.checkpoint.save else None

    def _claim_save_directory(self) -> SaveLock | None:
        """Refuse, on every rank and before any work, a --save directory that some rank cannot write or that
        another run holds; the coordinator holds the lock until `close`."""
        root = self.config.checkpoint.save
        problem = unwritable(root)
        lock = None
        if self.is_coordinator and problem is None:
            lock, problem = SaveLock.acquire(root)
        try:
            agree(problem, self.group)
        except CheckpointError:
            if lock is not None:
                lock.release()
            raise
        return lock

    # -----------------------------------------------------------------------------------------------------
    # Save

    def save_checkpoint(self, iteration: int, consumed_samples: int, model: list, optimizer,
                        loader_state: dict | None = None) -> float:
        """Save after `iteration` completed iterations, with the train data loader's position at
        `consumed_samples` when it has one (JSON values); returns the seconds training was blocked."""
        start = time.perf_counter()
        self.maybe_finalize_async_save(blocking=True)
        if iteration == self.last_saved_iteration:
            return time.perf_counter() - start
        root = self.config.checkpoint.save
        pieces = model_sharded_state_dict(model, self.pstate)
        optimizer_values = {}
        if optimizer is not None:
            optimizer_pieces, optimizer_values = to_boxes(optimizer.sharded_state_dict(), self.pstate)
            pieces += optimizer_pieces
        tag = layout_tag(self.config, self.device)
        pieces += rng_pieces(tag, self.pstate.rank, rng_states(model, self.device))
        pieces = _dcp()[1].boxes_to_write(pieces, self.group)
        if self.is_coordinator:
            directory.prepare(root, iteration)
        self._barrier()
        metadata = {"format": FORMAT, "iteration": iteration, "consumed_samples": consumed_samples,
                    "optimizer": optimizer_values,
                    "layout": {**dataclasses.asdict(self.pstate.layout),
                               "vp": self.config.virtual_pipeline_stages},
                    "rng_layout": tag, "config": self.config.to_dict(), "versions": _versions(),
                    "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if loader_state is not None:
            metadata["data_loader"] = loader_state
        self.last_saved_iteration = iteration
        if self.executor is None:
            self._write(pieces, root, iteration, metadata)
        else:
            self.pending = self.executor.submit(self._write, self._stage(pieces), root, iteration, metadata)
        return time.perf_counter() - start

    @torch.no_grad()
    def _stage(self, pieces: list[ShardedTensor]) -> list[ShardedTensor]:
        """Copies of the boxes in CPU memory that training cannot change; views of the same memory (an fp32
        weight and its own master) are copied once."""
        buffers, self.staging = self.staging, {}
        copies, staged = {}, []
        for piece in pieces:
            data = piece.data
            view = (data.untyped_storage().data_ptr(), data.storage_offset(), tuple(data.shape), data.stride())
            if view not in copies:
                copy = buffers.get((piece.key, piece.global_offset))
                if copy is None or copy.shape != data.shape or copy.dtype != data.dtype:
                    copy = torch.empty(data.shape, dtype=data.dtype, pin_memory=data.is_cuda)
                copies[view] = copy.copy_(data)
            self.staging[(piece.key, piece.global_offset)] = copies[view]
            staged.append(dataclasses.replace(piece, data=copies[view]))
        return staged

    def _write(self, pieces: list[ShardedTensor], root: str, iteration: int, metadata: dict) -> None:
        """Write and checksum this rank's boxes; once every rank has, the coordinator commits, and every rank
        learns whether it did."""
        start = time.perf_counter()
        temporary = directory.temporary_path(root, iteration)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp, planners = _dcp()
            writer = planners.RecordingFileSystemWriter(temporary)
            dcp.save(planners.state_dict_of(pieces), planner=planners.ShardedSavePlanner(pieces), storage_writer=writer,
                     process_group=self.group, no_dist=not self.distributed)
        records, problem = _records_of_own_files(temporary, writer.written_files)
        everyone = all_gather((records, problem), self.group)
        problem = next((p for _, p in everyone if p is not None), None)
        if self.is_coordinator and problem is None:
            files = {name: record for records, _ in everyone for name, record in records.items()}
            problem = self._commit(root, iteration, metadata, files, start)
        agree(problem, self.group)

    def _commit(self, root: str, iteration: int, metadata: dict, files: dict, start: float) -> str | None:
        """Commit on the coordinator (DCP's index is checksummed here, where it was written); returns why
        it could not, for every rank to raise."""
        temporary = directory.temporary_path(root, iteration)
        records, problem = _records_of_own_files(temporary, [checksums.DCP_INDEX_FILE])
        if problem is not None:
            return problem
        try:
            path = directory.commit(root, iteration, {**metadata, "files": {**files, **records}},
                                    self.config.checkpoint.keep_last_n)
        except CheckpointError as error:
            return str(error)
        except OSError as error:
            return f"cannot commit the checkpoint of iteration {iteration} in {root}: {error}"
        nbytes = sum(record["bytes"] for record in files.values())  # the data files, as stored_bytes counts
        print(f" saved checkpoint at iteration {iteration} to {path} ({nbytes / 1e6:.1f} MB "
              f"in {time.perf_counter() - start:.2f} s)", flush=True)
        return None

    def maybe_finalize_async_save(self, blocking: bool) -> None:
        """Finish a background save: re-raise its error; with `blocking`, wait for it on every rank."""
        if self.pending is None or not (blocking or self.pending.done()):
            return
        pending, self.pending = self.pending, None
        pending.result()  # every rank's save ends with the agreed commit: no barrier needed

    def close(self, wait_for_peers: bool = True) -> None:
        """Finish a background save. A run ending on an error passes `wait_for_peers=False`: the save in
        flight (of a good iteration) still completes where every rank gets this far, but no barrier waits
        for ranks that may never arrive."""
        if wait_for_peers:
            self.maybe_finalize_async_save(blocking=True)
            if self.group is not None:  # every rank is past its last use (the barrier above)
                self._barrier()
                dist.destroy_process_group(self.group)
                self.group = None
        elif self.pending is not None:
            pending, self.pending = self.pending, None
            pending.exception()
        if self.executor is not None:
            self.executor.shutdown()
        if self.save_lock is not None:  # the save directory is free for the next run
            self.save_lock.release()

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    # -----------------------------------------------------------------------------------------------------
    # Load

    def iteration_to_load(self) -> int | None:
        """The iteration --load (and --ckpt-step) will load, the same on every rank; None: none, train from
        scratch. Decided once, so that the model can be built knowing whether its weights will be loaded."""
        if self._iteration_to_load is _UNDECIDED:
            c = self.config.checkpoint
            self._iteration_to_load = decided_by_coordinator(
                lambda: directory.iteration_to_load(c.load, c.ckpt_step), self.group, self.is_coordinator)
        return self._iteration_to_load

    def load_checkpoint(self, model: list, optimizer) -> ResumeState:
        """Load the newest complete checkpoint of --load (or --ckpt-step's) into the model (and optimizer, RNG,
        position), after verifying its files."""
        c = self.config.checkpoint
        iteration = self.iteration_to_load()
        if iteration is None:
            if c.finetune:
                raise CheckpointError(f"--finetune needs a checkpoint, but --load {c.load} holds none")
            self._log(f" no checkpoint in {c.load}; training from scratch")
            return ResumeState()
        path = directory.checkpoint_path(c.load, iteration)
        saved = directory.read_metadata(path)
        self._verify_files(path, saved.get("files"), lambda: directory.previous_complete(c.load, iteration))
        dcp, planners = _dcp()
        stored = planners.SafeFileSystemReader(path).read_metadata()
        pieces = model_sharded_state_dict(model, self.pstate)
        optimizer_state = None
        if optimizer is not None and not (c.no_load_optim or c.finetune):
            _refuse_another_optimizer(path, saved, self.config.optimizer.optimizer)
            optimizer_state = optimizer.sharded_state_dict()
            pieces += to_boxes(optimizer_state, self.pstate)[0]
        rng = None
        tag = layout_tag(self.config, self.device)
        if not (c.no_load_rng or c.finetune):
            if saved.get("rng_layout") == tag:
                rng = {name: torch.empty_like(state) for name, state in rng_states(model, self.device).items()}
                pieces += rng_pieces(tag, self.pstate.rank, rng)
            else:
                self._log(f" random generator states not restored: saved in layout {saved.get('rng_layout')}, "
                          f"running in {tag}")
        self._agree_loadable(pieces, stored, path, saved.get("config", {}).get("model", {}))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(planners.state_dict_of(pieces), planner=planners.ShardedLoadPlanner(pieces),
                     storage_reader=planners.SafeFileSystemReader(path), process_group=self.group,
                     no_dist=not self.distributed)
        if optimizer_state is not None:  # filled in place; the plain values come from metadata.json
            optimizer.load_sharded_state_dict({**optimizer_state, **saved["optimizer"]})
        elif optimizer is not None:
            optimizer.reload_model_params()
        self._log(f" loaded checkpoint {path} (saved in layout {saved['rng_layout']}) at iteration {iteration}")
        if c.finetune:
            return ResumeState()
        self.last_saved_iteration = iteration
        return ResumeState(iteration, saved["consumed_samples"], rng, saved.get("data_loader"))

    def _verify_files(self, path: str, records: dict | None, fallback) -> None:
        """Check every file against the size and CRC-32 recorded at save, each rank a share of the bytes;
        `fallback()` says what to load instead."""
        if records is None:
            self._log(f" {path} was saved without checksums: loading it unverified")
            return
        damage = checksums.damaged_file(path, records, checksums.share_of(records, *rank_and_size(self.group)))
        agree(None if damage is None else f"checkpoint {path} is damaged: {damage}; {fallback()}", self.group)

    def _agree_loadable(self, pieces: list[ShardedTensor], stored, path: str, saved_model: dict) -> None:
        """Raise on every rank if any rank cannot find what it needs, or if the checkpoint holds a model
        tensor no rank loads, before the collective load starts."""
        problems = _dcp()[1].missing_or_mismatched(pieces, stored)
        hint = ""
        if problems and "optimizer." in problems[0]:
            hint = " (pass --no-load-optim to skip the optimizer state)"
        elif problems:
            hint = f"; the model configuration differs: {_model_differences(saved_model, self.config)}"
        agree(f"cannot load {path}: {problems[0]}{hint}" if problems else None, self.group)
        unused = self._first_unloaded_model_tensor(pieces, stored)
        if unused is not None:
            raise CheckpointError(f"cannot load {path}: it holds model tensor '{unused}', which this model has no "
                                  f"place for; {_model_differences(saved_model, self.config)}")

    def _first_unloaded_model_tensor(self, pieces: list[ShardedTensor], stored) -> str | None:
        """The first stored model tensor that no rank loads (each rank holds only its stages' layers, so the
        union over the ranks must cover them all). Optimizer and RNG states are skipped by flags, not here."""
        keys = sorted(k for k in stored.state_dict_metadata if not k.startswith(("optimizer.", "rng_state.")))
        loading = {piece.key for piece in pieces}
        loaded = torch.tensor([key in loading for key in keys], dtype=torch.int32)
        if self.group is not None:
            mappings.all_reduce(loaded, self.group, op=dist.ReduceOp.MAX)
        return next((key for key, flag in zip(keys, loaded.tolist()) if not flag), None)

    def _log(self, message: str) -> None:
        if self.is_coordinator:
            print(message, flush=True)


def _refuse_another_optimizer(path: str, saved: dict, running: str) -> None:
    """A checkpoint's optimizer state is its --optimizer's (Adam's moments, Muon's momentum): another optimizer
    starts from the weights alone, which --no-load-optim says (every rank reads the same metadata.json)."""
    stored = saved.get("config", {}).get("optimizer", {}).get("optimizer", "adam")
    if stored != running:
        raise CheckpointError(f"cannot load {path}: its optimizer state is --optimizer {stored}'s and this run "
                              f"has --optimizer {running}; pass --no-load-optim to start {running} from its weights")


def _records_of_own_files(directory_path: str, names: list[str]) -> tuple[dict, str | None]:
    """Checksum records of files this process just wrote, or why they could not be read back."""
    try:
        return checksums.records_of(directory_path, names), None
    except OSError as error:
        return {}, f"cannot read back {error.filename} to checksum it: {error.strerror}"


def _model_differences(saved_model: dict, config: Config) -> str:
    """The model settings that differ between the run that saved a checkpoint and this one, for errors."""
    ours = config.to_dict()["model"]
    differing = [f"{key} {value} (this run: {ours.get(key)})" for key, value in sorted(saved_model.items())
                 if ours.get(key) != value and key != "model_preset"]
    if not differing:
        return "the model configuration differs from the one that saved it"
    return "it was saved with " + ", ".join(differing[:3])


def read_checkpoint_tensors(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every global tensor of checkpoint directory `path` whose key starts with `prefix`, whole, read in this
    process alone (for tools and tests; a training run loads only its own boxes)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp, planners = _dcp()
    stored = planners.SafeFileSystemReader(path).read_metadata()
    pieces = [ShardedTensor(key, torch.empty(md.size, dtype=md.properties.dtype), tuple(md.size), (0,) * len(md.size))
              for key, md in stored.state_dict_metadata.items()
              if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(planners.state_dict_of(pieces), planner=planners.ShardedLoadPlanner(pieces),
                 storage_reader=planners.SafeFileSystemReader(path), no_dist=True)
    return {piece.key: piece.data for piece in pieces}
