"""Megatron-LM checkpoints -> megatron_lite checkpoints, and back (torch_dist), a layer at a time.

megatron_to_mlite reads a torch_dist or torch checkpoint of any TP/PP (and, for torch_dist, EP: its tensors
are global), maps its saved flags to ours (arguments.py), checks that its tensors are exactly the tensors
of the model those flags build here (a layer count that disagrees with the flags, a tensor too many or too
few, a wrong shape: one line each), and writes an ordinary checkpoint at the source's iteration and consumed
samples, so `pretrain_gpt.py --load` continues the run: the iteration count, the data position and the
learning-rate schedule go on (the schedule is a function of the iteration and the carried flags), and Adam's
moments and step count where the checkpoint holds them in model space (optimizer_state.py; otherwise the run
resumes with --no-load-optim and Adam starts from zero moments).

mlite_to_megatron writes one iteration of a torch_dist checkpoint that Megatron-Core's
`dist_checkpointing.load` reads at any TP/PP/EP: the global tensors under Megatron-Core's keys (layers
stacked when all are alike, as Megatron-Core's TransformerBlock requests them), the vocabulary padded as
Megatron pads it at the target TP, and common.pt with the args, iteration and scheduler state Megatron-LM's
loader reads. Model weights only.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from collections.abc import Iterator

import torch

from megatron_lite.checkpoint.sharded import ShardedTensor
from megatron_lite.config.arguments import field_owner, make_config
from megatron_lite.config.flag_dependencies import acting_flags
from megatron_lite.config.layer_specs import layer_specs
from megatron_lite.config.sections import Config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.errors import ConfigError
from megatron_lite.hf.checkpoint import (
    ModelCheckpoint,
    config_from_metadata,
    model_flags,
    resolve_checkpoint,
    write_model_checkpoint,
)
from megatron_lite.hf.checkpoint_parts import PartsWriter
from megatron_lite.hf.configs import ConversionError
from megatron_lite.megatron_lm import names
from megatron_lite.megatron_lm.arguments import flags_from_megatron, megatron_args
from megatron_lite.megatron_lm.checkpoint import TRACKER_FILE, open_checkpoint, read_in_units, saved_args
from megatron_lite.megatron_lm.optimizer_state import OptimizerState, optimizer_state
from megatron_lite.model.provider import build_model_chunk
from megatron_lite.model.sharding import initialization_skipped
from megatron_lite.parallel.state import ParallelState

_OPTIMIZER_KEY = re.compile(r"^optimizer\.state\.\w+?\.(?=embedding\.|decoder\.|output_layer\.|mtp\.)")
_DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                  "common_backend_version": 1}


def expected_tensors(config: Config) -> dict[str, tuple[int, ...]]:
    """Our global name -> stored shape (vocabulary unpadded) of every tensor the model of `config` checkpoints,
    from the model built on the meta device (nothing allocated)."""
    pstate = ParallelState.single()
    with initialization_skipped():
        model = build_model_chunk(config, pstate, device=torch.device("meta"))
    shapes = {}
    for name, tensor in [*model.named_global_parameters(), *model.named_global_buffers()]:
        shape = tuple(tensor.spec.global_shape)
        shapes[name] = (tensor.spec.valid_rows, *shape[1:]) if tensor.spec.valid_rows is not None else shape
    return shapes


def config_from_megatron_flags(values: dict, tp: int, pp: int, source: str) -> tuple[Config, list[str]]:
    """The validated Config of the carried flag values, and the carried flags that do not act in this model
    (e.g. Megatron's default --kv-lora-rank in a model without MLA), which are left out."""
    raw = Config()
    owner = field_owner()
    for name, value in values.items():
        setattr(getattr(raw, owner[name]), name, value)
    acting = acting_flags(raw, list(values))
    data = [name for name in acting if owner[name] == "data"]  # validated by the run that reads the data
    try:
        config = make_config({**{name: values[name] for name in acting if name not in data}, "mock_data": True,
                              "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}, tp * pp)
    except ConfigError as error:
        raise ConversionError(f"{source}: its flags do not make a model this framework builds at TP{tp} x PP{pp}: "
                              f"{error}") from None
    config.data.mock_data = False
    for name in data:
        setattr(config.data, name, values[name])
    return config, sorted(name for name in set(values) - set(acting) if values[name] is not False)


def _units(sources: dict[str, names.Source]) -> Iterator[dict[str, names.Source]]:
    """The sources grouped as a streamed conversion reads them: each decoder layer (with its optimizer state),
    every other tensor alone."""
    layers, others = {}, {}
    for name, source in sources.items():
        split = names.split_layer_name(_OPTIMIZER_KEY.sub("", name))
        (layers.setdefault(split[0], {}) if split else others)[name] = source
    for name in [n for n in others if _OPTIMIZER_KEY.sub("", n).startswith("embedding.")]:
        yield {name: others.pop(name)}
    for layer in sorted(layers):
        yield layers[layer]
    for name, source in others.items():
        yield {name: source}


def _check_tensors(reader, sources: dict[str, names.Source], expected: dict, num_layers: int, path: str) -> None:
    layers = {split[0] for name in sources if (split := names.split_layer_name(name))}
    if layers and max(layers) + 1 != num_layers:
        raise ConversionError(f"{path} holds {max(layers) + 1} decoder layers, but its args say --num-layers "
                              f"{num_layers}; the checkpoint is damaged or its args belong to another model")
    missing, unexpected = sorted(expected.keys() - sources.keys()), sorted(sources.keys() - expected.keys())
    for problem, found in (("lacks", missing), ("holds a tensor this model has no place for:", unexpected)):
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise ConversionError(f"{path} {problem} '{found[0]}'{more} for the model its args describe")
    for name, source in sources.items():
        shape = reader.shapes[source.key][len(source.index):]
        if tuple(shape) != tuple(expected[name]):
            raise ConversionError(f"{path}: '{source.key}' gives '{name}' the shape {tuple(shape)}, but the model its "
                                  f"args describe has {tuple(expected[name])}")


def megatron_to_mlite(load_dir: str, save_dir: str, tp: int, pp: int, progress=iter) -> tuple[str, Config, dict]:
    """Convert; returns the iteration directory written, the run's Config and a summary (source, format,
    iteration, consumed samples, the flags not carried)."""
    reader, named_iteration = open_checkpoint(load_dir)
    args = saved_args(reader, reader.path)
    mapping = flags_from_megatron(args, reader.path)
    config, not_acting = config_from_megatron_flags(mapping.values, tp, pp, reader.path)
    sources = {}
    for key in reader.model_keys():
        sources.update(names.our_names(key, reader.shapes[key]))
    _check_tensors(reader, sources, expected_tensors(config), config.model.num_layers, reader.path)
    iteration = int(reader.saved.get("iteration", named_iteration or 0))
    consumed = int(getattr(args, "consumed_train_samples", 0) or 0)
    optimizer = optimizer_state(reader, sources, has_masters=config.optimizer.bf16 or config.optimizer.fp16)
    summary = {"source": os.path.abspath(reader.path), "format": reader.format, "iteration": iteration,
               "consumed_samples": consumed, "carried": sorted(set(mapping.values) - set(not_acting)),
               "ignored": [*mapping.ignored, *not_acting],
               "optimizer_state": "read" if isinstance(optimizer, OptimizerState) else f"not read: {optimizer}"}
    if isinstance(optimizer, OptimizerState):
        sources.update(optimizer.sources)
    units = list(_units(sources))
    path = write_model_checkpoint(save_dir, read_in_units(reader, progress(units)), config, {"megatron": summary},
                                  iteration=iteration, consumed_samples=consumed,
                                  optimizer=optimizer.values if isinstance(optimizer, OptimizerState) else None)
    return path, config, summary


def resume_flags(config: Config, carried: list[str]) -> dict:
    """The flags (YAML keys for --config) a resume needs: the model's, and the `carried` schedule, data and
    run-length flags of the source."""
    settings = {}
    for section in ("optimizer", "training", "data", "checkpoint", "logging"):
        settings.update(dataclasses.asdict(getattr(config, section)))
    return {**model_flags(config.model), **{name: settings[name] for name in carried if name in settings}}


# ---------------------------------------------------------------------------------------------------------
# megatron_lite -> Megatron-LM torch_dist


def _stacked(config: Config) -> bool:
    """Whether Megatron-Core stores this model's layers stacked: not when --moe-layer-freq is a list or a
    number above 1 (TransformerBlock.sharded_state_dict's rule)."""
    freq = config.model.moe_layer_freq
    return not config.model.num_experts or (isinstance(freq, int) and freq <= 1)


_NO_EXTRA_STATE = [None]  # what Megatron-Core saves for a module without extra state (a list of the shards' data)


def _megatron_entries(name: str, tensor: torch.Tensor, config: Config, vocab_rows: int,
                      moe_layers: list[bool]) -> tuple[list[ShardedTensor], dict[str, list]]:
    """The boxes of Megatron-Core's tensors that our tensor `name` makes, and the `_extra_state` entries
    Megatron-Core requests beside a layer's linear weight (one ShardedObject per place along the stacked
    axes, keyed `<module>._extra_state/shard_<place>_<stacked shape>`)."""
    m = config.model
    split = names.split_layer_name(name)
    if split is None:
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            tensor = torch.cat([tensor, tensor.new_zeros(vocab_rows - tensor.shape[0], *tensor.shape[1:])])
        return [ShardedTensor.whole(name, tensor)], {}
    layer, rest = split
    key, expert = names.megatron_layer_key(rest)
    keys = [key]
    if moe_layers[layer] and rest.startswith("pre_mlp_layernorm."):
        keys.append(rest)  # Transformer Engine's MoE layers keep it unfused; the local spec fuses it
    index = () if expert is None else (expert,)
    shape = () if expert is None else (m.num_experts,)
    if _stacked(config):
        index, shape, prefix = (layer, *index), (m.num_layers, *shape), "decoder.layers."
    else:
        prefix = f"decoder.layers.{layer}."
    box = tensor.reshape((1,) * len(index) + tuple(tensor.shape))
    boxes = [ShardedTensor(prefix + k, box, (*shape, *tensor.shape), (*index, *(0,) * tensor.dim())) for k in keys]
    module, _, parameter = (prefix + key).rpartition(".")
    extra = {}
    if parameter == "weight" and module.rsplit(".", 1)[-1].startswith("linear_"):
        place = ".".join(map(str, index)) or "0"
        extra[f"{module}._extra_state/shard_{place}_{'.'.join(map(str, shape)) or '1'}"] = _NO_EXTRA_STATE
    return boxes, extra


def _not_written_for_megatron(m) -> str | None:
    """What of the model this export does not write under Megatron-Core's own names, or None."""
    if m.multi_latent_attention or m.mtp_num_layers:
        return "multi-latent attention or multi-token prediction"
    if m.experimental_attention_variant is not None:
        return f"{m.experimental_attention_variant} layers"
    if m.window_size is not None or m.softmax_type != "vanilla":
        return "sliding windows or attention sinks"
    if "M" in (m.hybrid_layer_pattern or "") or m.squared_relu:
        return "Mamba-2 layers or squared-ReLU MLPs (Megatron-Core's MambaMixer needs mamba_ssm's CUDA kernels, so " \
               "no CPU reference checks those names)"
    return None


def mlite_to_megatron(load_dir: str, save_dir: str, iteration: int | None, layout: dict, progress=iter) -> str:
    """Write the checkpoint `load_dir` names as a Megatron-LM torch_dist checkpoint in `save_dir`, padded for
    `layout` (tensor/pipeline/expert_model_parallel_size); returns the iteration directory."""
    path = resolve_checkpoint(load_dir, iteration)
    checkpoint = ModelCheckpoint(path)
    config = config_from_metadata(checkpoint.saved)
    m = config.model
    unwritten = _not_written_for_megatron(m)
    if unwritten:
        raise ConversionError(f"{path} has {unwritten}, which Megatron-LM's format is not written with here yet; "
                              f"export it with --direction mlite-to-hf instead")
    tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    try:  # Megatron-LM refuses at load what does not split, after the export claimed success
        make_config({**model_flags(m), "mock_data": True, "tensor_model_parallel_size": tp,
                     "pipeline_model_parallel_size": pp}, tp * pp)
    except ConfigError as error:
        raise ConversionError(f"{path} cannot be written for Megatron-LM at TP{tp} x PP{pp}: {error}") from None
    iteration, consumed = checkpoint.saved["iteration"], checkpoint.saved["consumed_samples"]
    vocab_rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    moe_layers = [spec.routed_experts for spec in layer_specs(m)]
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    temporary = final + ".tmp"
    os.makedirs(temporary)
    writer = PartsWriter(temporary)
    sources = {name: names.Source(name) for name in checkpoint.entries}
    for unit in progress(list(_units(sources))):
        tensors = checkpoint.read(unit)
        boxes, extra_states = [], {}
        for name, tensor in tensors.items():
            more_boxes, more_states = _megatron_entries(name, tensor, config, vocab_rows, moe_layers)
            boxes += more_boxes
            extra_states.update(more_states)
        writer.save_boxes(boxes)
        if extra_states:
            writer.save_objects(extra_states)
    writer.close()
    common = {"args": megatron_args(config, layout, consumed, iteration), "checkpoint_version": 3.0,
              "iteration": iteration, "opt_param_scheduler": _scheduler_state(config, consumed),
              "num_floating_point_operations_so_far": 0}
    buffer = io.BytesIO()
    torch.save(common, buffer)
    with open(os.path.join(temporary, "common.pt"), "wb") as f:
        f.write(buffer.getvalue())
    with open(os.path.join(temporary, "metadata.json"), "w", encoding="utf-8") as f:
        json.dump(_DIST_METADATA, f)
    os.replace(temporary, final)
    with open(os.path.join(save_dir, TRACKER_FILE), "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
    return final


def _scheduler_state(config: Config, consumed: int) -> dict:
    """Megatron-Core's OptimizerParamScheduler.state_dict() for this run at `consumed` samples (its steps count
    samples: each iteration steps it by the global batch)."""
    o, t = config.optimizer, config.training
    batch = t.global_batch_size
    warmup = o.lr_warmup_samples or (o.lr_warmup_iters or 0) * batch
    decay = o.lr_decay_samples or (o.lr_decay_iters or t.train_iters or 0) * batch
    return {"max_lr": o.lr, "lr_warmup_steps": warmup, "num_steps": consumed, "lr_decay_style": o.lr_decay_style,
            "lr_decay_steps": decay, "min_lr": o.min_lr, "start_wd": o.start_weight_decay or o.weight_decay,
            "end_wd": o.end_weight_decay or o.weight_decay, "wd_incr_style": o.weight_decay_incr_style,
            "wd_incr_steps": (t.train_iters or 0) * batch}
