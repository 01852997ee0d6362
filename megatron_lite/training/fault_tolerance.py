"""Fault-tolerant data parallelism across replica groups, with torchft (--fault-tolerance torchft).

The job is --ft-num-replica-groups replica groups, each an ordinary run of its own (its own torchrun, any TP x PP
x CP x EP x DP layout, the same in every group) and each rank one member of torchft's replica dimension: rank r of
every group holds the same shards, so after a group has reduced its gradients as usual, torchft's managed process
group averages each rank's reduced gradients with rank r of the other live groups (`average_gradients`), and the
optimizer steps only when torchft's quorum commits the step (`commit`).

A lighthouse (torchft's, started beside the groups by scripts/launch_replica_groups.sh) forms a quorum of the live
groups at the start of every step. When a group dies its peers' reduction fails, the step is not committed and is
run again on the same data with a new quorum without it; the survivors go on alone, each step averaging the live
groups only. When the group restarts, its first quorum finds it behind: it takes the live weights, optimizer
state and position from a peer over torchft's checkpoint transport (no checkpoint is read) and rejoins.

The batch and the data order. Each group trains --global-batch-size samples per step, its own share of the job's
sample stream: group g's data-parallel rank d reads as rank g x dp + d of g_total x dp ranks, so with every group
alive the job is one run at g_total times the batch, whose mean gradient the average of the groups' means is
(torchtitan's and torchft's choice). A step taken while a group is down averages the live groups only: its loss is
renormalised over the samples trained rather than padded to Megatron's global batch (which would need the dead
group's samples), and the dead group's share of that step is skipped, never repeated. Which steps each group
committed, and so which samples were trained, is in every group's log (`ft_participants` per iteration); a step's
samples are a function of the step alone, so a healed group resumes with its own share of the next step.

Peer transfers use torchft's HTTP transport, read back with weights_only=True: the state holds tensors and
plain values only, so a peer's bytes never run code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import warnings
from datetime import timedelta

import torch

from megatron_lite.config.fault_tolerance import lighthouse_endpoint
from megatron_lite.config.sections import Config
from megatron_lite.errors import UserError, debug_requested
from megatron_lite.model.sharding import FlatShard
from megatron_lite.parallel.state import ParallelState


def data_parallel_position(config: Config, dp_rank: int, dp_size: int) -> tuple[int, int, int]:
    """(rank, ranks, samples per own sample) of this data-parallel rank in the job's sample stream: with replica
    groups, group g's rank d is rank g x dp + d of g_total x dp, and the stream moves g_total samples for each
    sample a group consumes; else the rank as it is."""
    t = config.training
    if t.fault_tolerance is None:
        return dp_rank, dp_size, 1
    return t.ft_replica_id * dp_size + dp_rank, t.ft_num_replica_groups * dp_size, t.ft_num_replica_groups


def _weights_only_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport, loading what it receives with weights_only=True."""
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f, warnings.catch_warnings():
                # the tensors are copied into the model and optimizer: that they share a read-only buffer is moot
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                return _streaming_load(f, weights_only=True)

    transport = WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)
    handler = getattr(getattr(transport, "_server", None), "RequestHandlerClass", None)
    if handler is not None:  # http.server's access line for every transfer a peer takes
        handler.log_request = lambda *args, **kwargs: None
    return transport


class _TorchftLines(logging.Filter):
    """torchft's log lines as a run should show them: the flight recorder's warning only where NCCL runs (it is
    NCCL's), and a peer lost inside a step, the event replica groups exist for, as one line without a traceback
    (kept with --debug)."""

    def __init__(self, nccl: bool):
        super().__init__()
        self.nccl = nccl

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "NCCL flight recorder" in message and not self.nccl:
            return False
        if record.exc_info and record.exc_info[1] is not None and not debug_requested():
            where = message.split("] ", 1)[0] + "]" if message.startswith("[") else "torchft:"
            error = str(record.exc_info[1]).split(" This is typically")[0]
            record.msg = (f"{where} a peer replica group was lost during the step ({error}); the step is not "
                          f"committed and runs again with the groups still alive")
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _check_lighthouse_listens(address: str, source: str, seconds: float = 10.0) -> None:
    """One line when nothing answers at the lighthouse's address, before torchft's quorum would wait its timeout
    (minutes) and end with a collective's message."""
    host, port = lighthouse_endpoint(address)
    try:
        socket.create_connection((host, port), timeout=seconds).close()
    except OSError as error:
        raise UserError(f"{source}: no lighthouse answers there ({error.strerror or error}); start it first "
                        f"(scripts/launch_replica_groups.sh does) or correct the address") from None


class ReplicaGroup:
    """This rank's member of torchft's replica dimension: quorum, gradient averaging, commit and healing."""

    def __init__(self, config: Config, pstate: ParallelState, model: list, optimizer, iteration: int):
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum and commit at INFO
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        t = config.training
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise UserError("--fault-tolerance torchft runs under torchrun (MASTER_ADDR and MASTER_PORT name the "
                            "replica group's store); launch each group with torchrun")
        _check_lighthouse_listens(t.lighthouse_address(), t.lighthouse_source())
        self.model, self.optimizer = model, optimizer
        timeout = timedelta(minutes=t.distributed_timeout_minutes)
        on_gpu = next(model[0].parameters()).device.type == "cuda"
        logging.getLogger("torchft.manager").addFilter(_TorchftLines(nccl=on_gpu))
        process_group = ProcessGroupNCCL(timeout=timeout) if on_gpu else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=process_group, load_state_dict=self._load_state_dict, state_dict=self._state_dict,
            min_replica_size=t.ft_min_replica_size, use_async_quorum=False,
            replica_id=f"megatron_lite_{t.ft_replica_id}",
            rank=pstate.rank, world_size=pstate.layout.world_size, store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]), lighthouse_addr=t.lighthouse_address(), init_sync=False,
            checkpoint_transport=_weights_only_transport(timeout), timeout=timeout, quorum_timeout=timeout)
        self.manager.load_state_dict({"step": iteration, "batches_committed": 0})
        self._in_step = False
        self._logs = pstate.rank == 0
        self._groups_seen: int | None = None

    # -- a step ------------------------------------------------------------------------------------------
    def start_step(self) -> int:
        """Join this step's quorum (once per attempt; healing from a peer if this group is behind): the
        iteration it runs, 0-based."""
        if not self._in_step:
            self.manager.start_quorum()
            self._in_step = True
            self._report_quorum_change()
        return self.manager.current_step()

    def _report_quorum_change(self) -> None:
        """One line when the quorum's groups change, whether a peer died inside a step (torchft's error, filtered
        above, says so too) or between steps (nothing fails then: the lighthouse just forms the quorum without
        it)."""
        groups = self.manager.num_participants()
        if self._logs and self._groups_seen is not None and groups != self._groups_seen:
            change = "a peer replica group was lost" if groups < self._groups_seen else "a replica group joined"
            print(f" replica groups at iteration {self.manager.current_step() + 1}: {groups} (was "
                  f"{self._groups_seen}; {change})", flush=True)
        self._groups_seen = groups

    def average_gradients(self) -> None:
        """Average every rank's reduced gradients with the live groups' (a failed peer leaves them unusable, and
        `commit` then refuses the step)."""
        works = [self.manager.allreduce(gradient) for chunk in self.model for gradient in chunk.reduced_gradients()]
        for work in works:
            work.wait()

    def commit(self) -> bool:
        """Whether every live group completed the step, so that the optimizer may apply it."""
        self._in_step = False
        return self.manager.should_commit()

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # -- the state a restarted group takes from a peer -----------------------------------------------------
    def _state_dict(self) -> dict:
        model = {name: param.detach() for chunk in self.model for name, param in chunk.module.named_global_parameters()}
        optimizer = {key: value.data if isinstance(value, FlatShard) else value
                     for key, value in self.optimizer.sharded_state_dict().items()}
        return {"model": model, "optimizer": optimizer}

    @torch.no_grad()
    def _load_state_dict(self, state: dict) -> None:
        for chunk in self.model:
            for name, param in chunk.module.named_global_parameters():
                param.copy_(state["model"][name])
        live = self.optimizer.sharded_state_dict()
        self.optimizer.load_sharded_state_dict({
            key: dataclasses.replace(value, data=state["optimizer"][key]) if isinstance(value, FlatShard)
            else state["optimizer"][key] for key, value in live.items()})
