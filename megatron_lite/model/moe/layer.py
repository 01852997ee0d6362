"""Mixture-of-Experts layer: router -> token dispatcher -> local experts -> dispatcher back.

An MoE layer replaces the dense MLP of the transformer layers --moe-layer-freq names (config/layer_pattern.py)
with E expert MLPs and a router that sends each token to k of them, so parameters grow with E while
the compute per token stays that of k experts (Switch Transformer, GShard, Mixtral).

Expert parallelism: the EP ranks (carved from the data x context parallel ranks of a pipeline stage,
see parallel/state.py) each hold E / ep experts. Local expert j of EP rank r is global expert
r E / ep + j and is named so (`decoder.layers.3.mlp.experts.<r E/ep + j>.linear_fc1.weight`), which makes
its initial value and checkpoint key independent of the layout. Expert gradients are reduced over the
expert-data-parallel group only (ShardSpec.expert), the router's over dp x cp like any dense weight.

Expert tensor parallelism: routed expert weights are split across the expert-tensor-parallel (ETP) ranks as
the dense MLP's are across TP: fc1 by output rows ([gate; up] halves split separately for SwiGLU), fc2 by
input columns. The layer is one region over the ETP group: the router runs on this rank's tokens, then the
tokens and their routing enter the region (all-gathered when the ranks hold different tokens: sequence
parallelism, or ETP ranks that are not this rank's TP peers; copied when TP ranks share them), every ETP
rank dispatches the same tokens over its own EP group and computes its slice of the experts, and the
combined per-token output, a partial sum over ETP, leaves the region with one reduce-scatter (all-reduce
when copied). With ETP = TP (the default) that is the dense MLP's communication, on T h values rather than
on the T k h expert outputs that Megatron reduce-scatters before its reverse all-to-all.

MoE parallel folding (--expert-tensor-parallel-size != TP, parallel/state.py): the ETP and EP groups are cut
from the stage's ranks independently of attention's TP group, e.g. attention at TP2 while the experts run at
ETP1 x EP2 on the same two ranks. Under TP > 1 the TP ranks must then hold different tokens, so sequence
parallelism is required, as Megatron requires it for MoE with TP.

The local experts run as one grouped GEMM (experts.py), with biases without --disable-bias-linear. A shared expert
(--moe-shared-expert-intermediate-size) is split over TP: with ETP = TP it runs on the region's tokens, so
its partial sum joins the routed experts' before the one reduction; otherwise in a TP region of its own.
With --moe-latent-size (Nemotron 3 Super) the routed experts work in a latent: this rank's tokens are projected
down to it before they enter the expert region and the region's combined output back up after it leaves (both
projections replicated over TP, their gradients partial sums over TP under sequence parallelism, as a norm's), so
the dispatch moves latent-sized rows; the router and the shared expert, then in a TP region of its own, see the
hidden state.
Megatron's --moe-shared-expert-overlap runs the shared expert on a side stream while the all-to-all is in
flight; the collectives here block (gloo, and NCCL on the compute stream), so there is nothing to overlap
and the flag is not offered.

Aux-loss-free balancing (--moe-router-enable-expert-bias, DeepSeek-V3): after each iteration,
`update_expert_biases` sums every MoE layer's tokens per expert over all ranks and moves each expert's
bias by --moe-router-bias-update-rate towards balance: up for an expert that took fewer tokens than the
mean, down for one that took more. Every rank computes it from the same summed counts, so the biases stay
identical everywhere; they are buffers with global names, saved and loaded with the weights.

Statistics (aux loss, z-loss, tokens per expert, dropped token copies) accumulate in each layer during
backward and are read, summed over ranks and reset by `moe_metrics` once per log interval.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_lite.config.layer_specs import numbered_layer_specs
from megatron_lite.config.sections import ModelConfig
from megatron_lite.model.loss_scaling import auxiliary_loss_weight
from megatron_lite.model.moe.experts import GroupedExperts, SharedExpertMLP
from megatron_lite.model.moe.router import MoEAuxLossAutoScaler, RouterLosses, TopKRouter, capacity_keep_mask
from megatron_lite.model.moe.token_dispatcher import TOKEN_DISPATCHERS
from megatron_lite.model.sharding import ShardSpec, new_parameter
from megatron_lite.parallel import mappings
from megatron_lite.parallel.state import ParallelState

# Columns of MoELayer.statistics.
_MICROBATCHES, _AUX_LOSS, _Z_LOSS, _DROPPED, _TOKENS_PER_EXPERT = 0, 1, 2, 3, 4


class MoELayer(torch.nn.Module):
    """The MLP of one MoE transformer layer (global index `layer_number`)."""

    runs_eagerly = True  # its dispatch sizes tensors by routing counts read on the host: no torch.compile graph

    def __init__(self, config: ModelConfig, pstate: ParallelState, layer_number: int, *, sequence_parallel: bool,
                 token_dispatcher: str):
        super().__init__()
        self.layer_number = layer_number
        self.num_experts = config.num_experts
        self.capacity_factor = config.moe_expert_capacity_factor
        self.tp_group, self.etp_group = pstate.group("tp"), pstate.group("etp")
        self.folded = pstate.etp_size != pstate.tp_size
        self.sequence_parallel = sequence_parallel
        self.gathers_tokens = sequence_parallel or self.folded  # else TP ranks hold the same tokens
        # The ranks holding pieces of one micro-batch, whose routing a capacity decision spans.
        self.micro_batch_groups = [group for group in (self.tp_group if sequence_parallel else None,
                                                       pstate.group("cp")) if group is not None]
        self.router = TopKRouter(config, pstate, sequence_parallel=sequence_parallel)
        self.experts = GroupedExperts(config, pstate.etp_size, config.num_experts // pstate.ep_size, pstate.etp_rank)
        self.shared_experts = (SharedExpertMLP(config, pstate.tp_size)
                               if config.moe_shared_expert_intermediate_size else None)
        latent = config.moe_latent_size
        self.fc1_latent_proj = self.fc2_latent_proj = None
        if latent is not None:
            h = config.hidden_size
            self.fc1_latent_proj = new_parameter(ShardSpec((latent, h), sequence_parallel=sequence_parallel), 1)
            self.fc2_latent_proj = new_parameter(ShardSpec((h, latent), init="scaled_normal",
                                                           sequence_parallel=sequence_parallel), 1)
        # the shared expert joins the routed experts' partial sums inside the region, where they share its tokens
        self.shared_in_region = not self.folded and latent is None
        self.token_dispatcher = TOKEN_DISPATCHERS[token_dispatcher](config.num_experts, pstate)
        # Since the last moe_metrics, in float64 on the model's device (None until the first backward):
        # micro-batches, this rank's shares of aux and z-loss, dropped token copies, tokens per expert.
        self.statistics: torch.Tensor | None = None
        # Tokens per expert routed by this rank since the last update_expert_biases (with an expert bias).
        self.load_since_bias_update: torch.Tensor | None = None
        # Since the last moe_step_losses: the first three columns of `statistics`, for the step's NaN check.
        self.step_losses: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, h] (each [s/tp, b, h] with sequence parallelism)."""
        probs, indices, losses = self.router(x)  # [s b, k] for this rank's tokens
        keep = self._capacity_keep_mask(probs, indices) if self.capacity_factor is not None else None
        record = self._statistics_record(losses, keep)
        probs = MoEAuxLossAutoScaler.apply(probs, losses.aux_loss + losses.z_loss,
                                           auxiliary_loss_weight(losses.num_tokens),
                                           lambda: self._record_statistics(record))
        tokens = x.reshape(-1, x.shape[-1])
        routed = tokens if self.fc1_latent_proj is None else F.linear(tokens, self.fc1_latent_proj)
        region_tokens, probs, indices, keep = self._enter_expert_region(routed, probs, indices, keep)  # [T, .]
        expert_inputs, tokens_per_expert, handle = self.token_dispatcher.dispatch(region_tokens, probs, indices,
                                                                                  keep)
        output = self.token_dispatcher.combine(self.experts(expert_inputs, tokens_per_expert), handle)
        if self.shared_experts is not None and self.shared_in_region:
            output = output + self.shared_experts(region_tokens)  # [T, h] partial sums over TP = ETP
        output = self._leave_expert_region(output)
        if self.fc2_latent_proj is not None:
            output = F.linear(output, self.fc2_latent_proj)
        if self.shared_experts is not None and not self.shared_in_region:
            output = output + self._shared_expert_output(tokens)
        return output.view(-1, *x.shape[1:])

    def _capacity_keep_mask(self, probs, indices):
        """[s b, k] bool for this rank's tokens: which token copies fit. Decided over the whole micro-batch: the
        routing of every rank holding a piece of it (sequence-parallel TP ranks, CP ranks) is gathered (small),
        and this rank keeps its own part."""
        all_probs, all_indices = probs.detach(), indices
        for group in self.micro_batch_groups:
            all_probs = mappings.all_gather_dim0(all_probs, group)
            all_indices = mappings.all_gather_dim0(all_indices, group)
        keep = capacity_keep_mask(all_probs, all_indices, self.num_experts, self.capacity_factor)
        for group in reversed(self.micro_batch_groups):
            keep = mappings.split_along_dim(keep, group, 0)
        return keep

    def _statistics_record(self, losses: RouterLosses, keep: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch's row of `statistics`."""
        device = losses.tokens_per_expert.device
        dropped = torch.zeros((), device=device) if keep is None else (~keep).sum().float()
        head = torch.stack([torch.ones((), device=device), losses.aux_loss.detach(), losses.z_loss.detach(), dropped])
        return torch.cat([head.double(), losses.tokens_per_expert.double()])

    def _record_statistics(self, record: torch.Tensor) -> None:
        self.statistics = record if self.statistics is None else self.statistics + record
        head = record[:_DROPPED]
        self.step_losses = head if self.step_losses is None else self.step_losses + head
        if self.router.expert_bias is not None:
            load = record[_TOKENS_PER_EXPERT:]
            self.load_since_bias_update = load if self.load_since_bias_update is None else \
                self.load_since_bias_update + load

    def _enter_expert_region(self, tokens, probs, indices, keep):
        """This rank's tokens and routing [T_local, .] -> those of every ETP rank [T, .]. The gradients of the
        tokens and probs from the ETP-split experts are partial, so they are summed over ETP."""
        if not self.gathers_tokens:
            return (mappings.copy_to_tensor_parallel_region(tokens, self.etp_group),
                    mappings.copy_to_tensor_parallel_region(probs, self.etp_group), indices, keep)
        if keep is not None:
            keep = mappings.all_gather_dim0(keep.to(torch.uint8), self.etp_group).bool()
        return (mappings.gather_from_sequence_parallel_region(tokens, self.etp_group),
                mappings.gather_from_sequence_parallel_region(probs, self.etp_group),
                mappings.all_gather_dim0(indices, self.etp_group), keep)

    def _leave_expert_region(self, output):
        """[T, h] partial sums over ETP -> this rank's tokens [T_local, h], summed."""
        if self.gathers_tokens:
            return mappings.reduce_scatter_to_sequence_parallel_region(output, self.etp_group)
        return mappings.reduce_from_tensor_parallel_region(output, self.etp_group)

    def _shared_expert_output(self, tokens):
        """The shared expert in a TP region of its own (folded layouts, latent experts): [T_local, h] ->
        [T_local, h]."""
        if not self.sequence_parallel:  # the TP ranks hold the same tokens
            partial = self.shared_experts(mappings.copy_to_tensor_parallel_region(tokens, self.tp_group))
            return mappings.reduce_from_tensor_parallel_region(partial, self.tp_group)
        partial = self.shared_experts(mappings.gather_from_sequence_parallel_region(tokens, self.tp_group))
        return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)


def moe_layers(model_chunks) -> list[MoELayer]:
    return [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, MoELayer)]


@torch.no_grad()
def update_expert_biases(model_chunks, pstate: ParallelState, m: ModelConfig) -> None:
    """After an iteration, with --moe-router-enable-expert-bias: each MoE layer's bias b_i += rate *
    sign(mean load - load_i), from the tokens per expert of the iteration summed over all ranks. A
    collective over the world: every rank calls it after every iteration."""
    if not (m.num_experts and m.moe_router_enable_expert_bias):
        return
    layers = moe_layers(model_chunks)
    device = next(model_chunks[0].parameters()).device
    table = torch.zeros(_numbered_layers(m), m.num_experts, dtype=torch.float64, device=device)
    for layer in layers:
        if layer.load_since_bias_update is not None:
            table[layer.layer_number] = layer.load_since_bias_update
        layer.load_since_bias_update = None
    # Each of a layer's counts is summed over the same copies (TP ranks routing the same tokens), which
    # scales the layer's loads alike and leaves the signs as one device's.
    mappings.all_reduce(table, pstate.group("world"))
    for layer in layers:
        load = table[layer.layer_number]
        layer.router.expert_bias += (m.moe_router_bias_update_rate * torch.sign(load.mean() - load)).float()


def moe_statistics(model_chunks) -> list[tuple]:
    """What this rank's MoE layers have accumulated since the last update and log (a copy), for
    `load_moe_statistics` to put back when an iteration is run again."""
    def copy(tensor):
        return None if tensor is None else tensor.clone()

    return [(copy(layer.statistics), copy(layer.load_since_bias_update)) for layer in moe_layers(model_chunks)]


def load_moe_statistics(model_chunks, saved: list[tuple]) -> None:
    for layer, (statistics, load) in zip(moe_layers(model_chunks), saved):
        layer.statistics = None if statistics is None else statistics.clone()
        layer.load_since_bias_update = None if load is None else load.clone()


def _numbered_layers(config: ModelConfig) -> int:
    """Decoder layers, then multi-token prediction layers: the global layer numbers in use."""
    return len(numbered_layer_specs(config))


def moe_layer_numbers(config: ModelConfig) -> list[int]:
    """Global indices of the MoE layers, multi-token prediction layers included (numbered after the decoder's)."""
    if not config.num_experts:
        return []
    return [number for number, spec in enumerate(numbered_layer_specs(config)) if spec.routed_experts]


@torch.no_grad()
def moe_metrics(model_chunks, pstate: ParallelState, m: ModelConfig, sequence_parallel: bool) -> dict:
    """Per MoE layer, since the last call: mean aux loss and z-loss per micro-batch (coefficients
    applied), tokens per expert and dropped token copies, summed over all ranks; resets the layers'
    statistics. A collective over the world: every rank calls it at the same iterations."""
    numbers = moe_layer_numbers(m)
    if not numbers:
        return {}
    layers = moe_layers(model_chunks)
    device = next(model_chunks[0].parameters()).device
    table = torch.zeros(_numbered_layers(m), _TOKENS_PER_EXPERT + m.num_experts, dtype=torch.float64,
                        device=device)
    for layer in layers:
        if layer.statistics is not None:
            table[layer.layer_number] = layer.statistics
        layer.statistics = None
    mappings.all_reduce(table, pstate.group("world"))
    router_copies = _router_copies(pstate, sequence_parallel)
    losses = _losses_per_microbatch(table[numbers], pstate, sequence_parallel).tolist()
    metrics = {}
    for number, (aux_loss, z_loss) in zip(numbers, losses):
        row = table[number]
        metrics[f"moe_aux_loss_layer_{number}"] = aux_loss
        metrics[f"moe_z_loss_layer_{number}"] = z_loss
        metrics[f"moe_dropped_tokens_layer_{number}"] = round(float(row[_DROPPED]) / router_copies)
        metrics[f"moe_tokens_per_expert_layer_{number}"] = [
            round(v) for v in (row[_TOKENS_PER_EXPERT:] / router_copies).tolist()]
    metrics["moe_aux_loss"] = sum(metrics[f"moe_aux_loss_layer_{n}"] for n in numbers) / len(numbers)
    metrics["moe_z_loss"] = sum(metrics[f"moe_z_loss_layer_{n}"] for n in numbers) / len(numbers)
    return metrics


def _router_copies(pstate: ParallelState, sequence_parallel: bool) -> int:
    """Ranks whose router sees the same tokens: the router's shares and counts, and the capacity decisions, are
    whole on every TP rank without sequence parallelism."""
    return 1 if sequence_parallel else pstate.tp_size


def _losses_per_microbatch(rows: torch.Tensor, pstate: ParallelState, sequence_parallel: bool) -> torch.Tensor:
    """[layers, 2]: each layer's aux loss and z-loss (coefficients applied) per micro-batch, from its rows of
    statistics summed over the world [layers, >= 3]; every micro-batch is seen by its tp x cp ranks."""
    microbatches = (rows[:, _MICROBATCHES] / (pstate.tp_size * pstate.cp_size)).clamp(min=1.0)
    return rows[:, _AUX_LOSS:_DROPPED] / _router_copies(pstate, sequence_parallel) / microbatches[:, None]


@torch.no_grad()
def moe_step_losses(model_chunks, pstate: ParallelState, m: ModelConfig,
                    sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """The auxiliary losses of the step just run that entered its backward, as moe_metrics reports them
    (averaged over the MoE layers): 0-dim tensors, equal on every rank, for the NaN and spike checks; resets.
    A collective over the world where such a loss exists (every rank calls it every step); {} otherwise."""
    numbers = moe_layer_numbers(m)
    judged = [name for name, enters in (("moe aux loss", m.moe_aux_loss_coeff > 0 and
                                         m.moe_router_load_balancing_type != "none"),
                                        ("moe z loss", m.moe_z_loss_coeff > 0)) if enters]
    if not numbers or not judged:
        return {}
    device = next(model_chunks[0].parameters()).device
    table = torch.zeros(_numbered_layers(m), _DROPPED, dtype=torch.float64, device=device)
    for layer in moe_layers(model_chunks):
        if layer.step_losses is not None:
            table[layer.layer_number] = layer.step_losses
        layer.step_losses = None
    mappings.all_reduce(table, pstate.group("world"))
    aux_loss, z_loss = _losses_per_microbatch(table[numbers], pstate, sequence_parallel).mean(dim=0)
    return {name: loss for name, loss in (("moe aux loss", aux_loss), ("moe z loss", z_loss)) if name in judged}
