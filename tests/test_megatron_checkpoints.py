"""Megatron-LM checkpoints in and out, against Megatron-Core itself (tests/megatron_reference.py, CPU and gloo).

Megatron-Core saves a dense and an MoE GPTModel at TP2 x PP2 (torch_dist, and the dense one in the torch
format too) and computes their logits at TP2 after its own resharding load. Converted here, the logits at
TP1 and TP2 x PP2 equal Megatron-Core's; a run continues from the converted checkpoint at Megatron's
iteration, consumed samples and learning rate (Megatron-Core's OptimizerParamScheduler is the reference);
what it saved, exported back, loads into Megatron-Core's GPTModel at TP2 with `dist_checkpointing.load`, whose
logits equal ours.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import pretrain_gpt
from megatron_lite.checkpoint.checkpointing import Checkpointer
from megatron_lite.checkpoint.load_path import load_problem
from megatron_lite.config.arguments import make_config
from megatron_lite.hf.checkpoint import resolve_checkpoint
from megatron_lite.inference.generation import load_model
from megatron_lite.model.gpt import gather_vocab_logits
from megatron_lite.optim.builder import build_optimizer
from megatron_lite.optim.finalize_grads import finalize_model_grads
from megatron_lite.training.loop import build_model, get_schedule, initialize, pretrain
from tests.harness import run_on_ranks
from tests.helpers import convert
from tests.megatron_reference import GLOBAL_BATCH, ITERATION, SECOND_STEP, SEQ, VOCAB, token_ids
from tests.test_hf_conversion import one_line_error
from tests.tolerances import assert_close_in_norm, assert_close_relative

ROOT = Path(__file__).resolve().parents[1]
ITERATION_DIR = f"iter_{ITERATION:07d}"
CASES = {"dense_dist": "dense", "dense_torch": "dense", "moe_dist": "moe"}


def megatron(ranks: int, *argv: str) -> None:
    """Run tests/megatron_reference.py under torchrun (its own world: Megatron-Core's parallel state is global)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(ranks), str(ROOT / "tests" / "megatron_reference.py"), *argv],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


def megatron_logits(out: Path, checkpoints: dict[str, tuple[str, Path]]) -> dict[str, torch.Tensor]:
    """{name: Megatron-Core's logits of token_ids()} for each (kind, torch_dist iteration directory)."""
    out.mkdir(parents=True, exist_ok=True)
    megatron(2, "logits", str(out), *(f"{kind}={path}" for kind, path in checkpoints.values()))
    found = torch.load(out / "logits.pt")
    return {name: found[str(path)] for name, (_, path) in checkpoints.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Megatron-Core's checkpoints, with its logits of them (`logits.pt`) and its Adam steps (`step/`)."""
    root = tmp_path_factory.mktemp("megatron")
    megatron(4, "reference", str(root))
    return root


@pytest.fixture(scope="module")
def reference_logits(saved) -> dict[str, torch.Tensor]:
    found = torch.load(saved / "logits.pt")
    return {kind: found[str(saved / f"{kind}_dist" / ITERATION_DIR)] for kind in ("dense", "moe")}


@pytest.fixture(scope="module")
def converted(saved, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    for name in CASES:
        convert("--direction", "megatron-to-mlite", "--load-dir", str(saved / name), "--save-dir", str(root / name))
    return {name: root / name for name in CASES}


def our_logits(path: Path) -> torch.Tensor:
    model, config = load_model(resolve_checkpoint(str(path)))
    with torch.no_grad():
        return model(token_ids(), torch.arange(SEQ))[..., :config.model.vocab_size]


def resume_flags(path: Path) -> dict:
    """config.yaml without its data flags (the tests train on mock data)."""
    flags = yaml.safe_load((path / "config.yaml").read_text())
    return {k: v for k, v in flags.items() if k not in ("data_path", "split", "num_workers")}


def test_converted_checkpoints_give_megatron_core_logits(converted, reference_logits):
    for name, kind in CASES.items():
        assert_close_relative(our_logits(converted[name]), reference_logits[kind], rel=1e-5, msg=name)


def _tp2_pp2_logits(cases: dict) -> dict:
    """Each converted checkpoint loaded at TP2 x PP2 (as --load does): the logits of token_ids() on the last stage."""
    found = {}
    for name, (path, flags) in cases.items():
        config = make_config({**flags, "mock_data": True, "tensor_model_parallel_size": 2,
                              "pipeline_model_parallel_size": 2, "load": path, "finetune": True,
                              "micro_batch_size": 2, "global_batch_size": 2, "device": "cpu"}, 4)
        pstate, device = initialize(config)
        model = build_model(config, pstate, pretrain_gpt.model_provider, device)
        Checkpointer(config, pstate, device).load_checkpoint(model, None)
        for chunk in model:
            chunk.eval()

        def forward_step(data_iterator, chunk, pstate=pstate):
            def loss_func(logits):
                return torch.zeros(()), torch.ones(()), {"logits": gather_vocab_logits(logits, pstate, VOCAB)}
            return chunk(token_ids(), torch.arange(SEQ)), loss_func

        with torch.no_grad():
            reports, _ = get_schedule(config)(forward_step, None, model, 1, pstate=pstate, config=config,
                                              forward_only=True)
        found[name] = reports[0]["logits"] if reports else None
    return found


def test_converted_checkpoints_at_tp2_pp2_give_megatron_core_logits(converted, reference_logits):
    cases = {name: (str(path), resume_flags(path)) for name, path in converted.items()}
    last_stage = run_on_ranks(4, _tp2_pp2_logits, cases)[-1]
    for name, kind in CASES.items():
        assert_close_relative(last_stage[name], reference_logits[kind], rel=1e-5, msg=name)


def test_saved_flags_become_the_resume_configuration(converted):
    flags = yaml.safe_load((converted["moe_dist"] / "config.yaml").read_text())
    assert flags["num_query_groups"] == 2 and flags["swiglu"] and flags["normalization"] == "RMSNorm"
    assert flags["vocab_size"] == VOCAB and flags["disable_bias_linear"] is True
    assert flags["num_experts"] == 4 and flags["moe_layer_freq"] == [0, 1, 1, 1]
    assert flags["lr"] == 3e-4 and flags["lr_decay_style"] == "cosine" and flags["train_iters"] == 100
    assert flags["global_batch_size"] == GLOBAL_BATCH and flags["data_path"] == ["1.0", "corpus_text_document"]
    assert "tokenizer_type" not in flags  # GPT2BPETokenizer: not a tokenizer of this framework
    saved = yaml.safe_load((converted["moe_dist"] / ITERATION_DIR / "metadata.json").read_text())
    assert saved["iteration"] == ITERATION and saved["consumed_samples"] == ITERATION * GLOBAL_BATCH
    ignored = saved["megatron"]["ignored"]
    assert {"tensor_model_parallel_size", "tokenizer_type", "tensorboard_queue_size", "kv_lora_rank"} <= set(ignored)
    assert "lr" not in ignored


def megatron_scheduler_lrs(common: dict, iterations: int) -> list[float]:
    """The learning rate Megatron-LM logs at each of the next iterations: Megatron-Core's OptimizerParamScheduler
    restored from the checkpoint's state and stepped by the global batch each iteration."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = common["args"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * GLOBAL_BATCH, lr_decay_steps=args.lr_decay_iters * GLOBAL_BATCH,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * GLOBAL_BATCH, wd_incr_style="constant")
    scheduler.load_state_dict(common["opt_param_scheduler"])
    lrs = []
    for _ in range(iterations):
        scheduler.step(increment=GLOBAL_BATCH)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.fixture(scope="module")
def continued(converted, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two more iterations of the converted dense run (fresh Adam moments), saved."""
    save = tmp_path_factory.mktemp("continued")
    values = {**resume_flags(converted["dense_dist"]), "mock_data": True, "load": str(converted["dense_dist"]),
              "no_load_optim": True, "save": str(save), "train_iters": ITERATION + 2, "save_interval": ITERATION + 2,
              "eval_interval": 1000, "log_interval": 1}
    history = pretrain(make_config(values, 1), pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    return save, history


def test_a_converted_run_continues_megatrons_iteration_samples_and_schedule(saved, continued):
    from megatron_lite.megatron_lm.pickles import load_megatron_pickle

    save, history = continued
    common = load_megatron_pickle(str(saved / "dense_dist" / ITERATION_DIR / "common.pt"))
    assert [h["iteration"] for h in history] == [ITERATION + 1, ITERATION + 2]
    for record, lr in zip(history, megatron_scheduler_lrs(common, 2)):
        assert record["lr"] == pytest.approx(lr, rel=1e-12)
    written = yaml.safe_load((save / f"iter_{ITERATION + 2:07d}" / "metadata.json").read_text())
    assert written["consumed_samples"] == (ITERATION + 2) * GLOBAL_BATCH


def test_checkpoints_exported_here_load_into_megatron_core_at_tp2(converted, continued, tmp_path):
    from megatron_lite.megatron_lm.pickles import load_megatron_pickle

    trained, _ = continued
    exports = {"trained": ("dense", trained), "moe": ("moe", converted["moe_dist"])}
    checkpoints = {}
    for name, (kind, source) in exports.items():
        convert("--direction", "mlite-to-megatron", "--load-dir", str(source), "--save-dir", str(tmp_path / name),
                "--target-tensor-parallel-size", "2")
        iteration = (tmp_path / name / "latest_checkpointed_iteration.txt").read_text().strip()
        checkpoints[name] = (kind, tmp_path / name / f"iter_{int(iteration):07d}")
    theirs = megatron_logits(tmp_path / "logits", checkpoints)
    for name, (_, source) in exports.items():
        assert_close_relative(theirs[name], our_logits(source), rel=1e-5, msg=name)
    common = load_megatron_pickle(str(checkpoints["trained"][1] / "common.pt"))
    assert common["iteration"] == ITERATION + 2
    assert common["args"].consumed_train_samples == (ITERATION + 2) * GLOBAL_BATCH
    assert common["opt_param_scheduler"]["num_steps"] == (ITERATION + 2) * GLOBAL_BATCH


def _second_step(path: str, flags: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Load a converted checkpoint with its optimizer state (as --load does), take SECOND_STEP as
    tests/megatron_reference.py's `step` takes it (no clipping): the logits of token_ids() before and after."""
    config = make_config({**flags, "mock_data": True, "load": path, "clip_grad": 0.0, "device": "cpu"}, 1)
    pstate, device = initialize(config)
    model = build_model(config, pstate, pretrain_gpt.model_provider, device)
    optimizer = build_optimizer(config, model, pstate)
    Checkpointer(config, pstate, device).load_checkpoint(model, optimizer)
    with torch.no_grad():
        before = model[0](token_ids(), torch.arange(SEQ))[..., :VOCAB]
    seed, lr = SECOND_STEP
    tokens = token_ids(seed, SEQ + 1)
    model[0].zero_grad_buffer()
    model[0](tokens[:, :-1], torch.arange(SEQ), labels=tokens[:, 1:]).sum().backward()
    finalize_model_grads(model, pstate, torch.tensor(float(tokens[:, 1:].numel())))
    optimizer.step(lr)
    model[0].eval()
    with torch.no_grad():
        return before, model[0](token_ids(), torch.arange(SEQ))[..., :VOCAB]


def test_adam_state_converted_with_the_model_gives_megatron_cores_next_step(saved, tmp_path):
    """Megatron-Core (its DDP and Adam, not the distributed optimizer) takes a step and saves model and
    optimizer; converted here, the next step from the loaded moments and step count moves the logits as
    Megatron-Core's own next step does.

    Compared in norm, relative to the step's change: Adam divides by the root of the second moment, so an
    element whose gradient is near zero (cancelling terms, rounded differently at TP2 there and TP1 here)
    moves by up to the learning rate either way. Megatron-Core's and this framework's first steps from equal
    weights and zero moments differ by 6e-4 of the change this way; starting the second step from zero moments
    instead of the loaded ones differs by 0.48."""
    convert("--direction", "megatron-to-mlite", "--load-dir", str(saved / "step" / "dense_optim"), "--save-dir",
            str(tmp_path / "converted"))
    written = yaml.safe_load((tmp_path / "converted" / f"iter_{ITERATION + 1:07d}" / "metadata.json").read_text())
    assert written["megatron"]["optimizer_state"] == "read" and written["optimizer"]["optimizer.step"] == 1
    before, after = run_on_ranks(1, _second_step, str(tmp_path / "converted"), resume_flags(tmp_path / "converted"))[0]
    assert_close_in_norm(after - before, torch.load(saved / "step" / "step_logits.pt") - before, rel=5e-3)


# -------------------------------------------------------------------------------------------------------
# Bad input: one line each


def _copy(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(saved / "dense_dist", copy)
    return copy


def _rewrite_common(path: Path, **changes) -> None:
    common = torch.load(path / ITERATION_DIR / "common.pt", weights_only=False)
    common.update(changes)
    torch.save(common, path / ITERATION_DIR / "common.pt")


class Unfamiliar:
    """A class no Megatron-LM checkpoint holds."""


def test_damaged_or_unfamiliar_megatron_checkpoints_are_one_line(saved, tmp_path):
    copy = _copy(saved, tmp_path)
    (copy / ITERATION_DIR / "metadata.json").unlink()
    assert "has no metadata.json" in one_line_error("--direction", "megatron-to-mlite", "--load-dir", str(copy),
                                                    "--save-dir", str(tmp_path / "out1"))
    shutil.rmtree(copy)
    copy = _copy(saved, tmp_path)
    _rewrite_common(copy, args=Unfamiliar())
    message = one_line_error("--direction", "megatron-to-mlite", "--load-dir", str(copy), "--save-dir",
                             str(tmp_path / "out2"))
    assert "test_megatron_checkpoints.Unfamiliar" in message and "refusing to unpickle" in message
    args = torch.load(saved / "dense_dist" / ITERATION_DIR / "common.pt", weights_only=False)["args"]
    _rewrite_common(copy, args=argparse.Namespace(**{**vars(args), "num_layers": 6}))
    message = one_line_error("--direction", "megatron-to-mlite", "--load-dir", str(copy), "--save-dir",
                             str(tmp_path / "out3"))
    assert "holds 4 decoder layers, but its args say --num-layers 6" in message
    _rewrite_common(copy, args=argparse.Namespace(**{**vars(args), "multi_latent_attention": True}))
    assert "--multi-latent-attention True: such checkpoints are not read" in one_line_error(
        "--direction", "megatron-to-mlite", "--load-dir", str(copy), "--save-dir", str(tmp_path / "out6"))
    _rewrite_common(copy, args=argparse.Namespace(**{**vars(args), "apply_layernorm_1p": True}))
    assert "--apply-layernorm-1p True" in one_line_error("--direction", "megatron-to-mlite", "--load-dir", str(copy),
                                                          "--save-dir", str(tmp_path / "out4"))
    assert "not a Megatron-LM checkpoint" in one_line_error("--direction", "megatron-to-mlite", "--load-dir",
                                                            str(tmp_path), "--save-dir", str(tmp_path / "out5"))


def test_a_cut_short_or_missing_data_file_is_one_line_before_any_tensor_is_read(saved, tmp_path):
    copy = _copy(saved, tmp_path)
    largest = max((copy / ITERATION_DIR).glob("*.distcp"), key=lambda path: path.stat().st_size)
    size = largest.stat().st_size
    with open(largest, "r+b") as f:
        f.truncate(size // 2)
    message = one_line_error("--direction", "megatron-to-mlite", "--load-dir", str(copy), "--save-dir",
                             str(tmp_path / "out1"))
    assert f"{largest.name} holds {size // 2} bytes where .metadata indexes" in message and "cut short" in message
    largest.unlink()
    message = one_line_error("--direction", "megatron-to-mlite", "--load-dir", str(copy), "--save-dir",
                             str(tmp_path / "out2"))
    assert f"{largest.name} is missing" in message
    assert not (tmp_path / "out1").exists() and not (tmp_path / "out2").exists()


def test_load_of_a_megatron_checkpoint_names_the_conversion(saved):
    for path in (saved / "dense_dist", saved / "dense_torch" / ITERATION_DIR):
        problem = load_problem(str(path))
        assert "is a Megatron-LM checkpoint: convert it with tools/convert_checkpoint.py --direction " \
               "megatron-to-mlite" in problem


def test_an_export_megatron_could_not_load_is_one_line_and_writes_nothing(tmp_path):
    """A target TP that does not divide the heads is refused as the other directions refuse it, before any
    write (it once exited 0 with a checkpoint Megatron-LM refuses)."""
    import transformers

    from tests.helpers import convert, hf_config

    hf_dir, mlite_dir, save_dir = tmp_path / "hf", tmp_path / "mlite", tmp_path / "mlm"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config("llama")).save_pretrained(hf_dir)
    convert("--direction", "hf-to-mlite", "--load-dir", str(hf_dir), "--save-dir", str(mlite_dir))
    with pytest.raises(SystemExit, match=r"cannot be written for Megatron-LM at TP3 x PP1: .*num-attention-heads "
                                         r"\(4\) must be divisible by tensor-model-parallel-size \(3\)"):
        convert("--direction", "mlite-to-megatron", "--load-dir", str(mlite_dir), "--save-dir", str(save_dir),
                "--target-tensor-parallel-size", "3")
    assert not save_dir.exists()
