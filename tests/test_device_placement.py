"""Every tensor of a training step lives on the model's device: whole steps on a fake accelerator, no GPU.

Under torch's FakeTensorMode a tensor has a shape, a dtype and a device but no data, and every op checks
devices as the device kernels would: a CPU tensor in an accelerator op, or an accelerator value added into
a CPU tensor in place, raises (zero-dim CPU tensors mix in as scalars, as on CUDA). So a tensor of the hot
path created without `device=`, which CPU tests cannot see, fails here as it would at the first GPU step.

The fake accelerator is torch's "lazy" device, not "cuda": a CPU-only torch has no CUDA device guard, which
autograd asks for the stream of every CUDA tensor that requires grad (the process aborts) and the Python
bindings of Tensor.copy_, indexing and .item() ask for the device. The placement rules are the same for
every device but the CPU. Not exercised here: the code that branches on `device.type == "cuda"` (fused
AdamW, the CUDA random streams, the phase timers' CUDA events, the logger's synchronize and peak memory),
MoE layers (their routing has data-dependent shapes, which fake tensors cannot have) and activation
recomputation (torch.utils.checkpoint looks for a torch module of the device's name for its RNG state).

Stood in for, because fake tensors have no values and there is one process:
- reading a value to the host (.item(), float(), bool()) gives 1;
- collectives and p2p: a process group of one rank stands for every group of the layout, so that every
  collective code path runs; each call checks that its tensors are on the accelerator, as NCCL requires,
  and moves nothing.
"""
import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

import pretrain_gpt
from megatron_lite.config.arguments import make_config
from megatron_lite.optim.builder import build_optimizer
from megatron_lite.parallel.state import Layout, ParallelState
from megatron_lite.pipeline import schedules
from megatron_lite.training import loop as training
from megatron_lite.training.logging import TrainingLogger

ACCELERATOR = torch.device("lazy", 0)
TINY = {"model_preset": "llama-tiny", "mock_data": True, "num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64,
        "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 120, "seq_length": 16,
        "max_position_embeddings": 16, "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 2,
        "eval_iters": 1, "eval_interval": 1, "log_interval": 1}


class FakeAcceleratorMode(FakeTensorMode):
    """FakeTensorMode in which reading a tensor's value to the host gives 1."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)  # real CPU batches come in from the data loader

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            dtype = args[0].dtype
            return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Work:
    def wait(self):
        return True


def _collective(name: str):
    def call(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        wrong = [str(t.device) for t in tensors if t.device != ACCELERATOR]
        assert not wrong, f"dist.{name} was given tensors on {wrong}: NCCL takes GPU tensors only"
        return _Work() if kwargs.get("async_op") or name in ("isend", "irecv") else None
    return call


COLLECTIVES = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
               "reduce_scatter_single", "all_to_all_single", "isend", "irecv")


@pytest.fixture
def one_rank_group(monkeypatch):
    """torch.distributed as a process group of one rank whose collectives check where their tensors are."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, _collective(name), raising=False)


class OneRankEveryGroup(ParallelState):
    """A one-rank layout in which every group exists (of one rank), so that every collective is called."""

    def __init__(self):
        super().__init__(Layout(), 0, {}, [0])
        self.one_rank = object()  # what the package passes as `group=` to the one_rank_group collectives

    def group(self, kind: str):
        return self.one_rank


def train_and_evaluate(config, pstate: ParallelState) -> list[str]:
    """One training step, one evaluation and their log lines on the accelerator, as pretrain() runs them;
    returns the names of parameters that are not on the accelerator afterwards."""
    train_ds, valid_ds, _ = training.build_datasets(config)
    with FakeAcceleratorMode():
        model = training.build_model(config, pstate, pretrain_gpt.model_provider, ACCELERATOR)
        optimizer = build_optimizer(config, model, pstate)
        logger = TrainingLogger(config, ACCELERATOR, world_size=1, enabled=True)
        train = training.build_data_iterator(train_ds, config, pstate, 0)
        valid = training.build_data_iterator(valid_ds, config, pstate, 0)
        metrics = training.train_step(pretrain_gpt.forward_step, train, model, optimizer, config, pstate, 0,
                                      ACCELERATOR)
        metrics["consumed_samples"] = config.training.global_batch_size
        logger.log_iteration(1, metrics)
        loss = training.evaluate(pretrain_gpt.forward_step, valid, model, config, pstate, ACCELERATOR)
        logger.log_evaluation(1, loss)
    return [name for chunk in model for name, param in chunk.named_parameters() if param.device != ACCELERATOR]


def tiny_config(flags: dict, **one_rank_only):
    """TINY with `flags`, validated; then `one_rank_only` parallel settings, which validation refuses on one
    rank (virtual pipeline stages, sequence parallelism) but whose code paths run here all the same."""
    config = make_config({**TINY, **flags})
    for name, value in one_rank_only.items():
        setattr(config.parallel, name, value)
    return config


LAYOUTS = {"single_device": ParallelState.single, "every_group": OneRankEveryGroup}
SCHEDULES = {"no_pipelining": schedules.forward_backward_no_pipelining,
             "1f1b": schedules.forward_backward_pipelining_without_interleaving,
             "interleaved": schedules.forward_backward_pipelining_with_interleaving}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_training_step_keeps_every_tensor_on_the_accelerator(one_rank_group, monkeypatch, capsys, layout,
                                                             schedule):
    virtual_stages = {"num_layers_per_virtual_pipeline_stage": 1} if schedule == "interleaved" else {}
    config = tiny_config({}, **virtual_stages)  # interleaved: two model chunks on the one stage
    monkeypatch.setattr(training, "get_schedule", lambda config: SCHEDULES[schedule])
    assert train_and_evaluate(config, LAYOUTS[layout]()) == []
    assert " iteration      1/2 |" in capsys.readouterr().out


FEATURES = {
    "zero1_bf16": {"bf16": True, "data_parallel_sharding_strategy": "optim"},
    "zero2_overlap": {"data_parallel_sharding_strategy": "optim_grads", "overlap_grad_reduce": True,
                      "overlap_param_gather": True},
    "zero3": {"data_parallel_sharding_strategy": "optim_grads_params"},
    "offload_half_zero1_bf16": {"bf16": True, "data_parallel_sharding_strategy": "optim",
                                "optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5},
    "offload_zero3": {"data_parallel_sharding_strategy": "optim_grads_params", "optimizer_cpu_offload": True},
    "gpt2_dropout": {"model_preset": "gpt2-124m", "num_query_groups": None, "hidden_dropout": 0.1,
                     "attention_dropout": 0.0},
    "sequence_parallel": {},
}


@pytest.mark.parametrize("feature", FEATURES)
def test_feature_keeps_every_tensor_on_the_accelerator(one_rank_group, feature):
    config = tiny_config(FEATURES[feature], sequence_parallel=feature == "sequence_parallel")
    assert train_and_evaluate(config, OneRankEveryGroup()) == []
