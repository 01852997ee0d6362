"""What a run reports: one console line per interval, a JSON line per iteration, TensorBoard and W&B.

Throughput is measured on the logging rank (the last rank, which holds the loss) from wall time per
iteration; model FLOPs come from the formula in model/flops.py, MFU from the device's
peak (a table of common GPUs, or --peak-tflops). TensorBoard and W&B receive the scalars of the JSONL
records under the same names.
"""

from __future__ import annotations

import json
import os
import re
import resource
import time

import torch

from megatron_lite.checkpoint.directory import checkpoint_path
from megatron_lite.config.sections import Config, LoggingConfig
from megatron_lite.errors import UserError
from megatron_lite.files import read_text
from megatron_lite.model.flops import training_flops_per_token
from megatron_lite.training.straggler import StragglerReport, format_stragglers
from megatron_lite.training.timers import PhaseTimers

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets, without sparsity), matched against
# torch.cuda.get_device_name in this order: the most specific name first (H100 PCIe / NVL before H100).
PEAK_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
               ("A100", 312.0), ("A10G", 125.0), ("L40S", 362.0), ("L4", 121.0),
               ("A6000", 155.0), ("V100", 125.0), ("4090", 165.0), ("3090", 71.0), ("MI300X", 1307.0))


def device_peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    return peak_tflops_of(torch.cuda.get_device_name(device))


def peak_tflops_of(device_name: str) -> float | None:
    """The table's dense bf16 peak for a CUDA device name such as 'NVIDIA H100 PCIe', or None."""
    return next((peak for key, peak in PEAK_TFLOPS if key in device_name), None)


def memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory, or resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class TrainingLogger:
    """Collects per-iteration metrics on the logging rank and writes them where the user asked."""

    def __init__(self, config: Config, device: torch.device, world_size: int, enabled: bool,
                 stragglers: StragglerReport | None = None):
        self.config = config
        self.device = device
        self.world_size = world_size
        self.enabled = enabled
        self.stragglers = stragglers  # every rank's logger calls it at every log interval (a gather)
        self.flops_per_token = training_flops_per_token(config.model)
        self.peak_tflops = device_peak_tflops(device, config.logging.peak_tflops)
        self.last_time = time.perf_counter()
        self.jsonl = None
        self.tensorboard = None
        self.wandb = None
        if enabled:
            self._open_outputs()

    def _open_outputs(self) -> None:
        log = self.config.logging
        if log.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(log.metrics_jsonl)), exist_ok=True)
            self.jsonl = open(log.metrics_jsonl, "a")  # noqa: SIM115 - held open for the whole run
        if log.tensorboard_dir:
            self.tensorboard = open_tensorboard(self.config)
        if wandb_project(log):
            self.wandb = start_wandb(self.config)

    def reset_timer(self) -> None:
        self.last_time = time.perf_counter()

    def log_iteration(self, iteration: int, metrics: dict, timers: PhaseTimers | None = None) -> dict:
        """Record one finished iteration (1-based); prints every --log-interval iterations. Returns the
        record: the step's metrics with throughput, memory and (with `timers`) the time of each phase."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last_time = now - self.last_time, now
        batch = metrics.get("global_batch_size", self.config.training.global_batch_size)  # grows in a ramp-up
        tokens_per_sec = batch * self.config.model.seq_length / elapsed
        tflops = tokens_per_sec * self.flops_per_token / self.world_size / 1e12
        record = {"iteration": iteration, **metrics, "tokens_per_sec": tokens_per_sec,
                  "tflops_per_device": tflops, "iteration_time_s": elapsed, "memory_gib": memory_gib(self.device),
                  **(timers.read() if timers is not None else {})}
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        if self.stragglers is not None:
            self.stragglers.add(record)
            if iteration % self.config.logging.log_interval == 0:
                record.update(self.stragglers.report())
        if not self.enabled:
            return record
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        log = self.config.logging
        if self.tensorboard is not None and iteration % log.tensorboard_log_interval == 0:
            for key, value in tensorboard_scalars(record, log).items():
                self.tensorboard.add_scalar(key, value, iteration)
        if iteration % log.log_interval == 0:
            print(format_line(record, self.config.training.train_iters), flush=True)
            if self.wandb is not None:
                self.wandb.log(_scalars(record), step=iteration)
        return record

    def log_evaluation(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        print(f" validation at iteration {iteration} | lm loss {loss:.6f} | ppl {_perplexity(loss):.3f}",
              flush=True)
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("valid_lm_loss", loss, iteration)
        if self.wandb is not None:
            self.wandb.log({"valid_lm_loss": loss}, step=iteration)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"iteration": iteration, "valid_lm_loss": loss}) + "\n")
            self.jsonl.flush()

    def log_scalars(self, iteration: int, scalars: dict[str, float]) -> None:
        """Scalars of an evaluation other than the loss (downstream accuracies: `task/metric`), in every sink."""
        if not self.enabled or not scalars:
            return
        print(f" downstream at iteration {iteration} | "
              + " | ".join(f"{name} {value:.4f}" for name, value in scalars.items()), flush=True)
        named = {f"downstream/{name}": value for name, value in scalars.items()}
        if self.tensorboard is not None:
            for name, value in named.items():
                self.tensorboard.add_scalar(name, value, iteration)
        if self.wandb is not None:
            self.wandb.log(named, step=iteration)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"iteration": iteration, **named}) + "\n")
            self.jsonl.flush()

    def log_checkpoint(self, iteration: int) -> None:
        """After a save into --save: the W&B run summary names the newest checkpoint, and the run id is kept
        beside it, so that a run resuming from this checkpoint continues this W&B run."""
        if self.wandb is None:
            return
        save = self.config.checkpoint.save
        self.wandb.summary.update({"checkpoint_path": os.path.abspath(checkpoint_path(save, iteration)),
                                   "checkpoint_iteration": iteration})
        with open(os.path.join(save, WANDB_RUN_ID_FILE), "w") as f:
            f.write(self.wandb.id + "\n")

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _scalars(record: dict) -> dict:
    """The record's numbers by name, without the iteration (the step) and per-expert lists."""
    return {key: value for key, value in record.items()
            if key != "iteration" and isinstance(value, (int, float))}


def tensorboard_scalars(record: dict, log: LoggingConfig) -> dict:
    """The scalars TensorBoard receives: all of the record's, except (as in Megatron) the timers without
    --log-timers-to-tensorboard and the memory without --log-memory-to-tensorboard."""
    return {key: value for key, value in _scalars(record).items() if _on_tensorboard(key, log)}


def _on_tensorboard(key: str, log: LoggingConfig) -> bool:
    if key.startswith("time_") or key == "iteration_time_s":
        return log.log_timers_to_tensorboard
    return key != "memory_gib" or log.log_memory_to_tensorboard


def open_tensorboard(config: Config):
    """A SummaryWriter on --tensorboard-dir (a resumed run adds an event file beside the earlier ones; TensorBoard
    reads them as one run), holding the run's configuration as text."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=config.logging.tensorboard_dir)
    writer.add_text("config", "    " + json.dumps(config.to_dict(), indent=2).replace("\n", "\n    "))
    return writer


# -------------------------------------------------------------------------------------------------------
# W&B, by its conventions: WANDB_PROJECT and WANDB_DIR stand in for --wandb-project and --wandb-save-dir, and
# a run that resumes from a checkpoint continues the W&B run that saved it.

WANDB_RUN_ID_FILE = "wandb_run_id.txt"


def wandb_project(log: LoggingConfig) -> str | None:
    return log.wandb_project or os.environ.get("WANDB_PROJECT")


def wandb_run_id(config: Config) -> str | None:
    """WANDB_RUN_ID when set; else, resuming (not fine-tuning) from a checkpoint that a W&B run saved, that
    run's id; else None, for W&B to start a new run."""
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    c = config.checkpoint
    stored = os.path.join(c.load, WANDB_RUN_ID_FILE) if c.load and not c.finetune else None
    if stored is None or not os.path.lexists(stored):
        return None
    run_id = read_text(stored, UserError).strip()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id):
        raise UserError(f"{stored} holds {run_id[:40]!r}, not a W&B run id; remove it to start a new W&B run, or set "
                        f"WANDB_RUN_ID to the run to continue")
    return run_id


def start_wandb(config: Config):
    """The W&B run of this training run (a resumed one when its id exists), with the full configuration."""
    import wandb

    log = config.logging
    save_dir = log.wandb_save_dir or os.environ.get("WANDB_DIR")
    if save_dir:
        os.makedirs(save_dir, exist_ok=True)
    return wandb.init(project=wandb_project(log), name=log.wandb_exp_name, dir=save_dir, id=wandb_run_id(config),
                      resume="allow", config=config.to_dict())


def _perplexity(loss: float) -> float:
    return float(torch.tensor(loss).clamp(max=50).exp())


def format_line(r: dict, train_iters: int) -> str:
    parts = [f" iteration {r['iteration']:>6}/{train_iters}", f"consumed samples {r['consumed_samples']:>8}",
             f"lr {r['lr']:.3e}", f"lm loss {r['lm_loss']:.6f}", f"grad norm {r['grad_norm']:.3f}",
             f"tokens/s {r['tokens_per_sec']:,.0f}", f"TFLOP/s/device {r['tflops_per_device']:.2f}"]
    if "mfu" in r:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if "loader_tokens_per_sec" in r:  # what a raw-text loader can tokenize, against the tokens/s consumed
        parts.append(f"loader tokens/s {r['loader_tokens_per_sec']:,.0f}")
    if "time_forward_backward_ms" in r:
        parts.append("ms fwd-bwd/reduce/optim/data " + "/".join(
            f"{r[f'time_{phase}_ms']:.0f}" for phase in ("forward_backward", "grad_reduce", "optimizer", "data_wait")))
    if "mtp_loss" in r:
        parts.append(f"mtp loss {r['mtp_loss']:.6f}")
    if "moe_aux_loss" in r:
        parts.append(f"moe aux loss {r['moe_aux_loss']:.4g} | moe z loss {r['moe_z_loss']:.4g}")
    parts.append(f"mem {r['memory_gib']:.2f} GiB")
    if "stragglers" in r:
        parts.append(format_stragglers(r["stragglers"]))
    return " | ".join(parts)
