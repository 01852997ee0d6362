"""What a run reports: one console line per interval, a JSON line per iteration, and W&B.

Throughput is measured on the logging rank (the last rank, which holds the loss) from wall time per
iteration; model FLOPs come from the formula in `training_flops_per_token`, MFU from the device's
peak (a table of common GPUs, or --peak-tflops).
"""

from __future__ import annotations

import json
import os
import resource
import time

import torch

from megatron_lite.config import Config, ModelConfig
from megatron_lite.model.moe import moe_layer_numbers
from megatron_lite.timers import PhaseTimers

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets, without sparsity), matched against
# torch.cuda.get_device_name in this order: the most specific name first (H100 PCIe / NVL before H100).
PEAK_TFLOPS = (("H200 NVL", 835.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
               ("A100", 312.0), ("A10G", 125.0), ("L40S", 362.0), ("L4", 121.0),
               ("A6000", 155.0), ("V100", 125.0), ("4090", 165.0), ("3090", 71.0), ("MI300X", 1307.0))


def training_flops_per_token(config: ModelConfig) -> float:
    """Model FLOPs to train on one token, counting matrix multiplies only (as PaLM's MFU, appendix B).

    Forward: 2 FLOPs per weight of every linear layer (QKV, attention output, MLP or the top-k experts a
    token visits, output layer) plus the attention scores and weighted sum, 2 * 2 * seq * hidden per
    layer (the full square, as Megatron counts it). Backward costs twice the forward. Activation
    recomputation is not counted: it is work the hardware does, not work the model needs, so MFU stays
    comparable between runs with and without it.
    """
    h, s, L = config.hidden_size, config.seq_length, config.num_layers
    kv = config.num_query_groups * config.head_dim
    attention_weights = h * h + 2 * h * kv + h * h
    mlp_matrices = 3 if config.swiglu else 2
    dense_mlp = mlp_matrices * h * config.ffn_hidden_size
    if config.num_experts:
        moe_layers = len(moe_layer_numbers(config))
        moe_mlp = config.moe_router_topk * mlp_matrices * h * config.moe_ffn_hidden_size + h * config.num_experts
        mlp_weights = moe_layers * moe_mlp + (L - moe_layers) * dense_mlp
    else:
        mlp_weights = L * dense_mlp
    forward = 2 * (L * attention_weights + mlp_weights + h * config.vocab_size) + L * 4 * s * h
    return forward * 3


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

    def __init__(self, config: Config, device: torch.device, world_size: int, enabled: bool):
        self.config = config
        self.device = device
        self.world_size = world_size
        self.enabled = enabled
        self.flops_per_token = training_flops_per_token(config.model)
        self.peak_tflops = device_peak_tflops(device, config.logging.peak_tflops)
        self.tokens_per_iteration = config.training.global_batch_size * config.model.seq_length
        self.last_time = time.perf_counter()
        self.jsonl = None
        self.wandb = None
        if enabled:
            self._open_outputs()

    def _open_outputs(self) -> None:
        log = self.config.logging
        if log.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(log.metrics_jsonl)), exist_ok=True)
            self.jsonl = open(log.metrics_jsonl, "a")  # noqa: SIM115 - held open for the whole run
        if log.wandb_project:
            import wandb

            save_dir = log.wandb_save_dir or os.path.join(os.getcwd(), "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(project=log.wandb_project, name=log.wandb_exp_name, dir=save_dir,
                                    config=self.config.to_dict())

    def reset_timer(self) -> None:
        self.last_time = time.perf_counter()

    def log_iteration(self, iteration: int, metrics: dict, timers: PhaseTimers | None = None) -> dict:
        """Record one finished iteration (1-based); prints every --log-interval iterations. Returns the
        record: the step's metrics with throughput, memory and (with `timers`) the time of each phase."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last_time = now - self.last_time, now
        tokens_per_sec = self.tokens_per_iteration / elapsed
        tflops = tokens_per_sec * self.flops_per_token / self.world_size / 1e12
        record = {"iteration": iteration, **metrics, "tokens_per_sec": tokens_per_sec,
                  "tflops_per_device": tflops, "iteration_time_s": elapsed, "memory_gib": memory_gib(self.device),
                  **(timers.read() if timers is not None else {})}
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        if not self.enabled:
            return record
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        if iteration % self.config.logging.log_interval == 0:
            print(format_line(record, self.config.training.train_iters), flush=True)
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in record.items() if k != "iteration" and not isinstance(v, list)},
                               step=iteration)
        return record

    def log_evaluation(self, iteration: int, loss: float) -> None:
        if not self.enabled:
            return
        print(f" validation at iteration {iteration} | lm loss {loss:.6f} | ppl {_perplexity(loss):.3f}",
              flush=True)
        if self.wandb is not None:
            self.wandb.log({"valid_lm_loss": loss}, step=iteration)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"iteration": iteration, "valid_lm_loss": loss}) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def _perplexity(loss: float) -> float:
    return float(torch.tensor(loss).clamp(max=50).exp())


def format_line(r: dict, train_iters: int) -> str:
    parts = [f" iteration {r['iteration']:>6}/{train_iters}", f"consumed samples {r['consumed_samples']:>8}",
             f"lr {r['lr']:.3e}", f"lm loss {r['lm_loss']:.6f}", f"grad norm {r['grad_norm']:.3f}",
             f"tokens/s {r['tokens_per_sec']:,.0f}", f"TFLOP/s/device {r['tflops_per_device']:.2f}"]
    if "mfu" in r:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if "time_forward_backward_ms" in r:
        parts.append("ms fwd-bwd/reduce/optim/data " + "/".join(
            f"{r[f'time_{phase}_ms']:.0f}" for phase in ("forward_backward", "grad_reduce", "optimizer", "data_wait")))
    if "moe_aux_loss" in r:
        parts.append(f"moe aux loss {r['moe_aux_loss']:.4g} | moe z loss {r['moe_z_loss']:.4g}")
    parts.append(f"mem {r['memory_gib']:.2f} GiB")
    return " | ".join(parts)
