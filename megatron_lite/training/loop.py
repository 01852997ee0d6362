"""The training loop: initialize -> build model chunks -> optimizer -> data -> iterate, log, evaluate.

`pretrain(config, model_provider, forward_step_func)` is what `pretrain_gpt.py` calls, as in Megatron.
The loop reads top to bottom; each step it runs the schedule over the micro-batches of one global
batch, finalizes gradients (data-parallel reduction, loss normalisation), and steps the optimizer.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from megatron_lite.checkpoint.checkpointing import Checkpointer, ResumeState
from megatron_lite.checkpoint.graceful_exit import ExitConditions, ExitSignalHandler
from megatron_lite.config.layer_split import model_chunk_plans
from megatron_lite.config.schedules import schedule_warnings
from megatron_lite.config.sections import Config
from megatron_lite.data.mock import MockGPTDataset
from megatron_lite.data.samplers import PretrainingSampler
from megatron_lite.data.tokenizers import build_tokenizer, padded_vocab_size
from megatron_lite.errors import ConfigError
from megatron_lite.model.sharding import initialization_skipped
from megatron_lite.optim.builder import build_optimizer
from megatron_lite.optim.data_parallel import DistributedDataParallel
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.optim.lr_schedule import learning_rate, weight_decay
from megatron_lite.optim.optimizer import Optimizer
from megatron_lite.parallel import lifecycle, mappings
from megatron_lite.parallel.progress import RECORD
from megatron_lite.parallel.random import set_random_seed
from megatron_lite.parallel.state import Layout, ParallelState
from megatron_lite.pipeline import schedules
from megatron_lite.planning.report import theoretical_memory_report
from megatron_lite.training import memory_snapshots
from megatron_lite.training.fault_tolerance import ReplicaGroup, data_parallel_position
from megatron_lite.training.hang_report import arm_flight_recorder, hang_deadline, start_watchdog, unwatched
from megatron_lite.training.logging import TrainingLogger
from megatron_lite.training.output_paths import check_written_locations
from megatron_lite.training.profiling import StepProfiler
from megatron_lite.training.rerun_state_machine import (
    ReplayableIterator,
    RerunStateMachine,
    Result,
    rank_fingerprint,
)
from megatron_lite.training.straggler import StragglerReport
from megatron_lite.training.timers import PhaseTimers


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but CUDA is not available; use --device cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def initialize(config: Config) -> tuple[ParallelState, torch.device]:
    """Join the process group torchrun started (if any), build the parallel state, seed the generators."""
    device = resolve_device(config.training.device)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    p = config.parallel
    hierarchical_cp = p.hierarchical_context_parallel_sizes
    layout = Layout(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, dp=p.data_parallel_size,
                    pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                    etp=p.expert_tensor_parallel_size,
                    hierarchical_cp=tuple(hierarchical_cp) if hierarchical_cp else None,
                    dist_opt_instances=p.num_distributed_optimizer_instances)
    timeout = lifecycle.timeout_of(config.training.distributed_timeout_minutes)
    if world_size > 1 and device.type == "cuda" and hang_deadline(config) is not None:
        arm_flight_recorder()
    if world_size > 1:
        lifecycle.join(device, timeout)
    pstate = ParallelState.build(layout, timeout) if world_size > 1 else ParallelState.single()
    set_random_seed(config.training.seed, pstate.pp_rank)
    return pstate, device


def params_dtype(config: Config) -> torch.dtype:
    """The dtype of the model's weights and activations (gradients and masters stay fp32)."""
    o = config.optimizer
    return torch.bfloat16 if o.bf16 else torch.float16 if o.fp16 else torch.float32


def build_model(config: Config, pstate: ParallelState, model_provider, device) -> list[DistributedDataParallel]:
    """This rank's model chunks, each wrapped for data-parallel gradient reduction."""
    chunks = []
    for plan in model_chunk_plans(config, pstate.pp_rank):
        module = model_provider(config, pstate, plan, device)
        p = config.parallel
        chunks.append(DistributedDataParallel(
            module, pstate, bucket_size=p.ddp_bucket_size, overlap_grad_reduce=p.overlap_grad_reduce,
            overlap_param_gather=p.overlap_param_gather,
            data_parallel_sharding_strategy=p.data_parallel_sharding_strategy, param_dtype=params_dtype(config)))
    return chunks


def setup_model_and_optimizer(config: Config, pstate: ParallelState, model_provider,
                              device) -> tuple[list[DistributedDataParallel], Optimizer]:
    """This rank's model chunks, wrapped for data parallelism, and the optimizer that steps them."""
    model = build_model(config, pstate, model_provider, device)
    return model, build_optimizer(config, model, pstate)


# -------------------------------------------------------------------------------------------------------
# Data


def _num_samples(config: Config) -> tuple[int, int, int]:
    """Train, validation and test samples the run reads (evaluation batches are always --global-batch-size), of
    the whole job's sample stream (replica groups each read their share, data_parallel_position)."""
    t = config.training
    gbs = t.global_batch_size * data_parallel_position(config, 0, 1)[2]
    train = t.train_iters * gbs if t.train_samples is None else t.train_samples
    evaluations = t.train_iters // t.eval_interval  # the loop evaluates every eval_interval iterations
    return train, evaluations * t.eval_iters * gbs, t.eval_iters * gbs


def padded_vocab_for(config: Config) -> int:
    """Vocabulary rows of the embedding and output layers: a multiple of divisible-by x TP."""
    return padded_vocab_size(config.model.vocab_size, config.model.make_vocab_size_divisible_by,
                             config.parallel.tensor_model_parallel_size)


def set_vocab_size_from_tokenizer(config: Config) -> None:
    """With a real corpus, the model's vocabulary is the tokenizer's."""
    if not config.data.mock_data:
        tokenizer = build_tokenizer(config.data.tokenizer_type, config.data.tokenizer_model, config.model.vocab_size)
        config.model.vocab_size = tokenizer.vocab_size


def build_datasets(config: Config):
    """Train/valid/test datasets: synthetic with --mock-data, else the indexed corpus of --data-path (or
    --data-args-path) cut by --split, or a corpus per split from --train/--valid/--test-data-path.

    The corpus is checked against the model's vocabulary (the tokenizer's, unpadded: ids in the padding
    are as wrong as ids past it). Training never reads the test split, so it asks no test samples of the
    corpus, and a small corpus whose test share rounds to no documents still trains.
    """
    train_n, valid_n, test_n = _num_samples(config)
    m, d, seed = config.model, config.data, config.training.seed
    if d.mock_data:
        return (MockGPTDataset(train_n, m.seq_length, m.vocab_size, seed),
                MockGPTDataset(valid_n, m.seq_length, m.vocab_size, seed + 1),
                MockGPTDataset(test_n, m.seq_length, m.vocab_size, seed + 2))
    from megatron_lite.data import builder, raw_text

    if d.sft:  # conversations, one packed row a sample
        from megatron_lite.data.sft.builder import build_sft_datasets

        return build_sft_datasets(config, (train_n, valid_n, 0), log=raw_text.log_on_first_rank)
    if raw_text.uses_raw_text(d):
        return raw_text.build_datasets(config, (train_n, valid_n, 0), _loader_workers(config))
    options = {"cache_dir": d.data_cache_path, "vocab_size": m.vocab_size, "mmap_bin_files": d.mmap_bin_files}
    if d.train_data_path:
        return builder.build_per_split_datasets((d.train_data_path, d.valid_data_path, d.test_data_path),
                                                m.seq_length, seed, (train_n, valid_n, 0), **options)
    if d.data_args_path:
        return builder.build_train_valid_test_datasets(builder.read_data_args(d.data_args_path), d.split,
                                                       m.seq_length, seed, (train_n, valid_n, 0),
                                                       flag=f"--data-args-path {d.data_args_path}", **options)
    return builder.build_train_valid_test_datasets(d.data_path, d.split, m.seq_length, seed, (train_n, valid_n, 0),
                                                   **options)


def _collate(samples, eod: int | None = None, reset_position_ids: bool = False, reset_attention_mask: bool = False,
             eod_mask_loss: bool = False) -> dict[str, torch.Tensor]:
    """Samples of seq_length + 1 tokens -> inputs, next-token labels, loss mask, positions [s].

    Megatron's document flags, with `eod` the end-of-document id (an EOD token belongs to the document it
    ends; the token after it starts the next one): reset_position_ids makes positions [b, s] restart at 0 in
    each document, reset_attention_mask adds document_ids [b, s] for attention within documents, and
    eod_mask_loss zeroes the loss mask where the input token is an EOD.
    """
    tokens = torch.as_tensor(torch.utils.data.default_collate(list(samples)), dtype=torch.long)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    is_eod = inputs == eod if eod is not None else torch.zeros_like(inputs, dtype=torch.bool)  # [b, s]
    batch = {"tokens": inputs, "labels": labels,
             "loss_mask": (~is_eod if eod_mask_loss else torch.ones_like(is_eod)).float(),
             "position_ids": _document_positions(is_eod) if reset_position_ids else torch.arange(inputs.shape[1])}
    if reset_attention_mask:
        batch["document_ids"] = _document_ids(is_eod)
    return batch


def _document_ids(is_eod: torch.Tensor) -> torch.Tensor:
    """[b, s] EOD flags -> [b, s] each token's document: the number of EOD tokens before it."""
    eods = is_eod.long()
    return eods.cumsum(dim=1) - eods


def _document_positions(is_eod: torch.Tensor) -> torch.Tensor:
    """[b, s] EOD flags -> [b, s] each token's position in its document: its distance from the token after the
    last EOD before it (or from the sequence start)."""
    index = torch.arange(is_eod.shape[1]).expand_as(is_eod)
    next_start = torch.where(is_eod, index + 1, 0)  # where the document after each EOD starts
    start = torch.cat((torch.zeros_like(index[:, :1]), next_start[:, :-1]), dim=1).cummax(dim=1).values
    return index - start


def _collate_fn(dataset, config: Config):
    """SFT samples (already inputs, labels and masks) stacked as they are; else _collate with --reset-position-ids,
    --reset-attention-mask and --eod-mask-loss, and the end-of-document id they look for: the tokenizer's, or mock
    data's (MockGPTDataset.eod)."""
    d = config.data
    if d.sft:
        return torch.utils.data.default_collate
    if not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        return _collate
    eod = (dataset.eod if isinstance(dataset, MockGPTDataset)
           else build_tokenizer(d.tokenizer_type, d.tokenizer_model, config.model.vocab_size).eod)
    return functools.partial(_collate, eod=eod, reset_position_ids=d.reset_position_ids,
                             reset_attention_mask=d.reset_attention_mask, eod_mask_loss=d.eod_mask_loss)


def _loader_workers(config: Config) -> int:
    on_gpu = resolve_device(config.training.device).type == "cuda"
    return config.data.num_workers if config.data.num_workers is not None else (2 if on_gpu else 0)


def _streamed(dataset):
    """The train dataset when it is a raw-text stream, whose position each checkpoint saves and a resume
    restores (data/raw_text.py); None for indexed and mock data, whose samples follow from consumed_samples."""
    from megatron_lite.data import raw_text

    return dataset if isinstance(dataset, raw_text.RawTextDataset) else None


def build_data_iterator(dataset, config: Config, pstate: ParallelState, consumed_samples: int):
    """Micro-batches for this data-parallel rank, starting after `consumed_samples`.

    On a GPU, loader processes prepare the next micro-batches while the GPU computes, into pinned memory
    so that forward_step's non-blocking copies overlap too. On the CPU they would only compete with
    training for the same cores."""
    if dataset is None or len(dataset) == 0:
        return None
    rank, ranks, stride = data_parallel_position(config, pstate.dp_rank, pstate.dp_size)
    sampler = PretrainingSampler(len(dataset), consumed_samples * stride, config.training.micro_batch_size, rank, ranks)
    from megatron_lite.data import raw_text

    if isinstance(dataset, raw_text.RawTextDataset):  # tokenized in the loader's workers, packed here
        return raw_text.data_iterator(dataset, sampler, _collate_fn(dataset, config))
    on_gpu = resolve_device(config.training.device).type == "cuda"
    workers = _loader_workers(config)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=_collate_fn(dataset, config),
                                         num_workers=workers, pin_memory=on_gpu, persistent_workers=workers > 0)
    return iter(loader)


# -------------------------------------------------------------------------------------------------------
# One step


def get_schedule(config: Config):
    """The schedule for the layout, by Megatron's names."""
    if config.parallel.pipeline_model_parallel_size == 1:
        return schedules.forward_backward_no_pipelining
    if config.virtual_pipeline_stages is not None:
        return schedules.forward_backward_pipelining_with_interleaving
    if config.parallel.pipeline_schedule == "gpipe":
        return schedules.forward_backward_pipelining_gpipe
    if config.parallel.pipeline_schedule == "zb-h1":
        return schedules.forward_backward_pipelining_zero_bubble
    return schedules.forward_backward_pipelining_without_interleaving


def reduce_loss(reports: list[dict], pstate: ParallelState, device) -> torch.Tensor:
    """The global-batch mean of the 'lm loss' sums (0 without tokens: an SFT batch of prompts alone), computed on
    the last pipeline stage and shared with the other stages so that every rank reports it; a 0-dim tensor on
    `device`. As in Megatron, this token mean is the reported loss under either loss normalisation."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for report in reports:
        loss_sum, tokens = report["lm loss"]
        totals[0] += loss_sum.double()
        totals[1] += tokens.double()
    mappings.all_reduce(totals, pstate.group("dp_cp"))
    mappings.broadcast(totals, pstate.pp_ranks[-1], pstate.group("pp"))
    return totals[0] / totals[1].clamp(min=1.0)


def train_step(forward_step_func, data_iterator, model, optimizer: Optimizer, config: Config,
               pstate: ParallelState, iteration: int, device, timers: PhaseTimers | None = None,
               consumed_samples: int | None = None, rerun: RerunStateMachine | None = None,
               replica: ReplicaGroup | None = None) -> dict | None:
    """Forward and backward over one global batch, then one optimizer step. `rerun` judges the losses (the language
    model's and those the model adds, model/contract.py TrainingHooks: MTP depths, MoE auxiliary and z-losses) and
    gradient norm before the step is applied and may run the iteration
    again (rerun_state_machine.py; without it, only --check-for-nan-in-loss-and-grad applies: a non-finite loss
    or gradient norm stops the run).
    Every rank judges the same reduced values, so every rank decides alike. `timers` collects the time of
    each phase. The samples consumed before the step (default: `iteration` batches of --global-batch-size,
    right without --rampup-batch-size) decide its global batch size, learning rate and weight decay. With a
    `replica` group (--fault-tolerance) the reduced gradients are averaged over the live groups and the step is
    applied only if they all completed it; else nothing is applied, the data and generators are rewound for the
    iteration to run again, and None is returned."""
    timers = timers or PhaseTimers(torch.device("cpu"))
    rerun = rerun or RerunStateMachine(config, pstate.rank, mode="disabled")
    if consumed_samples is None:
        consumed_samples = iteration * config.training.global_batch_size
    global_batch_size = config.global_batch_size_at(consumed_samples)
    hooks = model[0].training_hooks()
    rerun.start_iteration(model, device, data_iterator, replayable=replica is not None)
    RECORD.set_step("the start of the step", iteration + 1)
    while True:
        if replica is not None:
            replica.start_step()
        for chunk in model:
            chunk.zero_grad_buffer()
        with timers.phase("forward_backward"):
            reports, tokens = get_schedule(config)(
                forward_step_func, data_iterator, model, config.num_microbatches_at(consumed_samples),
                pstate=pstate, config=config, loss_scale=optimizer.loss_scale)
        fingerprint = rank_fingerprint(reports, model, device) if rerun.names_faulty_ranks else None
        RECORD.set_step("gradient reduction")
        with timers.phase("grad_reduce"):
            finalize_model_grads(model, pstate, tokens)
            if replica is not None:
                replica.average_gradients()
        auxiliary_losses = hooks.step_losses(model)
        RECORD.set_step("the optimizer step")
        with timers.phase("optimizer"):
            grad_norm = optimizer.prepare_grads()
            lm_loss, grad_norm, *auxiliary_values = torch.stack(  # one sync
                [reduce_loss(reports, pstate, device), grad_norm, *auxiliary_losses.values()]).tolist()
        judged = dict(zip(auxiliary_losses, auxiliary_values))
        if not rerun.should_rerun(Result(lm_loss, grad_norm, fingerprint, judged), iteration, model, device,
                                  data_iterator):
            break
    if replica is not None and not replica.commit():
        rerun.replay(model, device, data_iterator)
        return None
    with timers.phase("optimizer"):
        lr = learning_rate(config, consumed_samples)
        update_successful = optimizer.apply(lr, grad_norm, weight_decay(config, consumed_samples))
        hooks.after_step(model)
    # logged as Megatron logs it: the scheduler's rate after the step, the one the next iteration uses
    next_lr = learning_rate(config, consumed_samples + global_batch_size)
    return {"lm_loss": lm_loss, **hooks.step_metrics(judged), "grad_norm": grad_norm,
            "lr": next_lr, "global_batch_size": global_batch_size, "loss_scale": optimizer.loss_scale,
            "skipped_iter": int(not update_successful),
            **({"ft_participants": replica.participants} if replica is not None else {})}


@torch.no_grad()
def evaluate(forward_step_func, data_iterator, model, config: Config, pstate: ParallelState, device) -> float:
    RECORD.set_step("evaluation")
    for chunk in model:
        chunk.eval()
    reports = []
    for _ in range(config.training.eval_iters):
        step_reports, _ = get_schedule(config)(forward_step_func, data_iterator, model, config.num_microbatches,
                                               pstate=pstate, config=config, forward_only=True)
        reports += step_reports
    for chunk in model:
        chunk.train()
    return float(reduce_loss(reports, pstate, device))


# -------------------------------------------------------------------------------------------------------
# The run


def pretrain(config: Config, model_provider, forward_step_func, non_loss_data_func=None) -> list[dict]:
    """Train `config.training.train_iters` iterations; returns the per-iteration metrics of this rank.
    `non_loss_data_func(model, pstate, device)`, as Megatron's, runs at each evaluation beside the validation
    loss (all ranks) and returns scalars to log ({name: value}; downstream accuracies, evaluation/in_training.py).

    However it ends (finished, exit interval or signal, error), the process groups this run created are
    destroyed before returning, so the process exits with the status the run deserves."""
    owns_process_group = not dist.is_initialized()
    pstate, device = initialize(config)
    try:
        return _train(config, pstate, device, model_provider, forward_step_func, non_loss_data_func)
    finally:
        lifecycle.shutdown(owns_process_group)


def _train(config: Config, pstate: ParallelState, device, model_provider, forward_step_func,
           non_loss_data_func=None) -> list[dict]:
    """Check the inputs that can be checked cheaply (the corpus, the checkpoint directory), then train. A
    background save still in flight when an error ends the run completes, but no rank waits for others."""
    if pstate.rank == 0:
        for warning in schedule_warnings(config):
            print(f"warning: {warning}", flush=True)
    snapshot_problem = memory_snapshots.validation_problem(config, device)
    if snapshot_problem is not None:
        raise ConfigError(snapshot_problem)
    check_written_locations(config, pstate.rank, pstate.layout.world_size, lifecycle.world_group())
    set_vocab_size_from_tokenizer(config)
    datasets = build_datasets(config)  # first: a broken corpus fails before any compute
    c = config.checkpoint
    checkpointer = Checkpointer(config, pstate, device) if c.save or c.load else None
    try:
        history = _run(config, pstate, device, model_provider, forward_step_func, datasets, checkpointer,
                       non_loss_data_func)
    except BaseException:
        if checkpointer is not None:
            checkpointer.close(wait_for_peers=False)
        raise
    if checkpointer is not None:
        checkpointer.close()
    return history


def _run(config: Config, pstate: ParallelState, device, model_provider, forward_step_func, datasets,
         checkpointer: Checkpointer | None, non_loss_data_func=None) -> list[dict]:
    """Build the model and optimizer, resume, and iterate: log, evaluate, save, stop when told to."""
    train_ds, valid_ds, _ = datasets
    c, t = config.checkpoint, config.training
    if pstate.rank == 0:
        print(theoretical_memory_report(config), flush=True)
    memory_history = memory_snapshots.MemoryHistory(config, pstate.rank, pstate.pp_rank, device)
    loads_weights = bool(c.load) and checkpointer.iteration_to_load() is not None
    with initialization_skipped(loads_weights):  # a checkpoint overwrites every parameter: draw none
        model, optimizer = setup_model_and_optimizer(config, pstate, model_provider, device)
    resume = checkpointer.load_checkpoint(model, optimizer) if c.load else ResumeState()
    replica = ReplicaGroup(config, pstate, model, optimizer, resume.iteration) if t.fault_tolerance else None
    if replica is not None:  # a restarted group takes the live state from a peer in its first quorum
        step = replica.start_step()
        if step != resume.iteration:
            resume = ResumeState(step, step * t.global_batch_size)
    consumed_samples = resume.consumed_samples
    streamed = _streamed(train_ds)
    if streamed is not None:
        streamed.restore_loader_state(resume.loader_state, consumed_samples)
    loader_state = streamed.loader_state if streamed is not None else lambda consumed: None  # for each save
    timers = PhaseTimers(device)
    train_iterator = ReplayableIterator(timers.timed_iterator(
        build_data_iterator(train_ds, config, pstate, consumed_samples) if resume.iteration < t.train_iters else None))
    rerun = RerunStateMachine(config, pstate.rank, lifecycle.world_group())
    evaluations_done = resume.iteration // t.eval_interval
    valid_consumed = evaluations_done * t.eval_iters * t.global_batch_size
    valid_iterator = (build_data_iterator(valid_ds, config, pstate, valid_consumed)
                      if evaluations_done < t.train_iters // t.eval_interval else None)
    resume.restore_rng(model, device)  # after the data loaders, which draw from the generator when built
    is_logging_rank = pstate.rank == pstate.layout.world_size - 1
    stragglers = (StragglerReport(config.logging.straggler_minmax_count, lifecycle.world_group(), pstate.rank,
                                  pstate.layout.world_size - 1, device) if config.logging.log_straggler else None)
    logger = TrainingLogger(config, device, pstate.layout.world_size, is_logging_rank, stragglers)
    lifecycle.startup_barrier(pstate.timeout)
    watchdog = start_watchdog(config, pstate)
    history = []
    for chunk in model:
        chunk.train()
    logger.reset_timer()
    completed = resume.iteration
    try:
        with (ExitSignalHandler(t.exit_signal_handler) as signal_handler,
              StepProfiler(config, pstate.rank, device, resume.iteration) as profiler):
            exit_conditions = ExitConditions(config, pstate, device, signal_handler)
            iteration = resume.iteration
            while iteration < t.train_iters:
                step = replica.start_step() if replica is not None else iteration
                if step != iteration:  # this group fell behind the live ones and took their state
                    iteration = step
                    consumed_samples = iteration * t.global_batch_size
                    train_iterator = ReplayableIterator(timers.timed_iterator(
                        build_data_iterator(train_ds, config, pstate, consumed_samples)))
                profiler.step(iteration)
                metrics = train_step(forward_step_func, train_iterator, model, optimizer, config, pstate,
                                     iteration, device, timers, consumed_samples, rerun, replica)
                if metrics is None:  # the replica groups did not commit it: run it again
                    continue
                consumed_samples += metrics["global_batch_size"]
                completed = iteration + 1
                if watchdog is not None:
                    watchdog.step_done()  # armed from the end of the first step, which may compile for minutes
                metrics["consumed_samples"] = consumed_samples
                if streamed is not None:
                    metrics["loader_tokens_per_sec"] = streamed.loader_tokens_per_sec()
                if completed % config.logging.log_interval == 0:
                    metrics.update(model[0].training_hooks().interval_metrics(model))  # e.g. MoE load balance
                    metrics.update(rerun.read_stats())
                    memory_history.dump(completed)
                history.append(logger.log_iteration(iteration + 1, metrics, timers))
                if completed % t.eval_interval == 0 and (valid_iterator is not None or non_loss_data_func):
                    if valid_iterator is not None:
                        logger.log_evaluation(completed, evaluate(forward_step_func, valid_iterator, model, config,
                                                                  pstate, device))
                    if non_loss_data_func is not None:
                        with unwatched(watchdog):  # the harness prepares requests between collectives
                            logger.log_scalars(completed, non_loss_data_func(model, pstate, device))
                    logger.reset_timer()
                if checkpointer is not None:
                    checkpointer.maybe_finalize_async_save(blocking=False)
                if c.save_interval and completed % c.save_interval == 0:
                    with unwatched(watchdog):
                        checkpointer.save_checkpoint(completed, consumed_samples, model, optimizer,
                                                     loader_state(consumed_samples))
                    logger.log_checkpoint(completed)
                    logger.reset_timer()
                reason = exit_conditions.reason(completed)
                if reason is not None:
                    if pstate.rank == 0:
                        print(f" exiting at iteration {completed}: {reason}", flush=True)
                    break
                iteration = completed
            if c.save:
                with unwatched(watchdog):
                    checkpointer.save_checkpoint(completed, consumed_samples, model, optimizer,
                                                 loader_state(consumed_samples))
                logger.log_checkpoint(completed)
    finally:
        if replica is not None:
            replica.shutdown()
        if watchdog is not None:
            watchdog.close()
        logger.close()
        memory_history.close()
    return history
