"""tools/convert_checkpoint.py for llama (GQA untied, tied with one KV head, and with Llama 3.1's RoPE scaling),
qwen2 (QKV biases), qwen3 (q/k head norms, head_dim other than hidden / heads), gpt2, mixtral, qwen3_moe
(renormalized top-k) and qwen2_moe (pre-softmax top-k, gated shared expert) built by transformers from configs:
our logits equal transformers' in one process and at TP2 x PP2 through the training load path, and the MoE
families' logits and greedy ids at EP2 x TP2 too; exported checkpoints load in transformers with our logits;
HF -> ours -> HF is tensor-identical; bad input fails with one line."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

import pretrain_gpt
from megatron_lite.checkpoint.checkpointing import Checkpointer, read_checkpoint_tensors
from megatron_lite.config.arguments import make_config
from megatron_lite.data.mock import MockGPTDataset
from megatron_lite.hf.checkpoint import resolve_checkpoint
from megatron_lite.inference.generation import load_model
from megatron_lite.model.gpt import gather_vocab_logits
from megatron_lite.training.loop import build_model, get_schedule, initialize, pretrain
from tests.harness import run_on_ranks
from tests.helpers import HF_FAMILIES, HF_VOCAB, convert, hf_models
from tests.tolerances import assert_close_relative

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SEQ = 32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE_FAMILIES = ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v3_no_q_latent", "nemotron_h_moe",
                "nemotron_h_latent"]
def read_text(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_json(path) -> dict:
    return json.loads(read_text(path))


def edit_json(path, change) -> None:
    content = read_json(path)
    change(content)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return hf_models(tmp_path_factory)


def hf_logits(hf_dir: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(ids).logits


def our_logits(mlite_dir: str, ids: torch.Tensor) -> torch.Tensor:
    model, config = load_model(resolve_checkpoint(mlite_dir))
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]))[..., :config.model.vocab_size]


def one_line_error(*argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        convert(*argv)
    message = str(exit_.value.code)
    assert message.startswith("convert_checkpoint.py: error: ") and "\n" not in message, message
    return message


# -------------------------------------------------------------------------------------------------------
# Parity


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_converted_model_logits_equal_transformers(converted, family):
    hf_dir, mlite_dir = converted[family]
    ids = torch.randint(0, HF_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    assert_close_relative(our_logits(mlite_dir, ids), hf_logits(hf_dir, ids), rel=1e-5)


def test_converted_checkpoint_carries_tokenizer_and_model_flags(converted):
    hf_dir, mlite_dir = converted["llama"]
    assert read_text(os.path.join(mlite_dir, "tokenizer.json")) == read_text(os.path.join(hf_dir, "tokenizer.json"))
    flags = yaml.safe_load(read_text(os.path.join(mlite_dir, "model.yaml")))
    assert flags["num_query_groups"] == 2 and flags["rotary_base"] == 50000.0 and flags["ffn_hidden_size"] == 96
    assert flags["tokenizer_type"] == "HuggingFaceTokenizer" and flags["tokenizer_model"] == os.path.abspath(mlite_dir)
    saved = read_json(os.path.join(resolve_checkpoint(mlite_dir), "metadata.json"))
    assert saved["iteration"] == 0 and saved["hf"]["model_type"] == "llama"
    keys = read_checkpoint_tensors(resolve_checkpoint(mlite_dir)).keys()
    assert not any(key.startswith(("optimizer.", "rng_state.")) for key in keys)


def _forward_logits(config, model, pstate, ids: torch.Tensor):
    """Logits [b, s, vocab] of `ids` through the pipeline schedule (forward only); None off the last stage."""
    positions = torch.arange(ids.shape[1])

    def forward_step(data_iterator, chunk):
        def loss_func(logits):
            return torch.zeros(()), torch.ones(()), {"logits": gather_vocab_logits(logits, pstate, HF_VOCAB)}
        return chunk(ids, positions), loss_func

    with torch.no_grad():
        reports, _ = get_schedule(config)(forward_step, None, model, 1, pstate=pstate, config=config,
                                          forward_only=True)
    return reports[0]["logits"] if reports else None


def _tp2_pp2(cases: dict, ids: torch.Tensor) -> dict:
    """For each converted checkpoint: logits after loading it at TP2 x PP2 (Checkpointer, as --load does), and
    the first loss of `pretrain_gpt.py --load DIR --finetune` at TP2 x PP2 on mock data."""
    results = {}
    for family, (mlite_dir, flags) in cases.items():
        config = make_config({**flags, "mock_data": True, "seq_length": SEQ, "tensor_model_parallel_size": 2,
                              "pipeline_model_parallel_size": 2, "load": mlite_dir, "finetune": True,
                              "micro_batch_size": 2, "global_batch_size": 2, "train_iters": 1, "eval_interval": 1000,
                              "log_interval": 1000, "lr": 1e-3, "device": "cpu"}, 4)
        pstate, device = initialize(config)
        model = build_model(config, pstate, pretrain_gpt.model_provider, device)
        Checkpointer(config, pstate, device).load_checkpoint(model, None)
        for chunk in model:
            chunk.eval()
        logits = _forward_logits(config, model, pstate, ids)
        history = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
        results[family] = (logits, history[0]["lm_loss"])
    return results


def run_case(mlite_dir: str) -> tuple[str, dict]:
    """A converted checkpoint and the flags of its model.yaml, without the tokenizer's (the runs use mock data)."""
    flags = yaml.safe_load(read_text(os.path.join(mlite_dir, "model.yaml")))
    return mlite_dir, {k: v for k, v in flags.items() if not k.startswith("tokenizer_")}


def assert_tp2_pp2_results_are_transformers(last_stage: dict, hf_dirs: dict[str, str], ids: torch.Tensor) -> None:
    """Each family's (logits of `ids`, first loss) from _tp2_pp2's last stage equal transformers' on its HF
    directory: the logits, and the cross-entropy of the first mock global batch."""
    dataset = MockGPTDataset(2, SEQ, HF_VOCAB, 1234)
    samples = torch.stack([torch.as_tensor(dataset[i]) for i in range(2)])  # the first global batch
    for family, hf_dir in hf_dirs.items():
        logits, first_loss = last_stage[family]
        assert_close_relative(logits, hf_logits(hf_dir, ids), rel=1e-4, msg=family)
        reference = torch.nn.functional.cross_entropy(hf_logits(hf_dir, samples[:, :-1]).reshape(-1, HF_VOCAB),
                                                      samples[:, 1:].reshape(-1))
        assert first_loss == pytest.approx(reference.item(), rel=1e-5), family


def test_converted_checkpoints_load_at_tp2_pp2_with_transformers_logits_and_loss(converted):
    ids = torch.randint(0, HF_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    cases = {family: run_case(mlite_dir) for family, (_, mlite_dir) in converted.items()}
    last_stage = run_on_ranks(4, _tp2_pp2, cases, ids)[-1]
    assert_tp2_pp2_results_are_transformers(last_stage, {family: hf for family, (hf, _) in converted.items()}, ids)


def _ep2_tp2(cases: dict, ids: torch.Tensor, new_tokens: int) -> dict:
    """For each converted MoE checkpoint loaded at EP2 x TP2 (Checkpointer, as --load does): the logits of
    `ids` and `new_tokens` greedy ids (argmax of the last position, the sequence recomputed each step)."""
    results = {}
    for family, (mlite_dir, flags) in cases.items():
        config = make_config({**flags, "mock_data": True, "seq_length": SEQ, "tensor_model_parallel_size": 2,
                              "expert_model_parallel_size": 2, "load": mlite_dir, "finetune": True,
                              "micro_batch_size": 2, "global_batch_size": 4, "train_iters": 1, "device": "cpu"}, 4)
        pstate, device = initialize(config)
        model = build_model(config, pstate, pretrain_gpt.model_provider, device)
        Checkpointer(config, pstate, device).load_checkpoint(model, None)
        for chunk in model:
            chunk.eval()
        tokens = ids
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, _forward_logits(config, model, pstate, tokens)[:, -1:].argmax(-1)], dim=1)
        results[family] = (_forward_logits(config, model, pstate, ids), tokens[:, ids.shape[1]:])
    return results


def test_converted_moe_checkpoints_at_ep2_tp2_give_transformers_logits_and_greedy_ids(converted):
    """Experts split over two expert-parallel ranks and each expert over two TP ranks; every rank runs the same
    prompts through its share of the experts."""
    ids = torch.randint(0, HF_VOCAB, (2, SEQ - 8), generator=torch.Generator().manual_seed(5))
    cases = {family: (converted[family][1], yaml.safe_load(read_text(os.path.join(converted[family][1], "model.yaml"))))
             for family in MOE_FAMILIES}
    per_rank = run_on_ranks(4, _ep2_tp2, cases, ids, 8)
    for family in MOE_FAMILIES:
        assert_ranks_give_transformers_logits_and_greedy_ids(per_rank, family, converted[family][0], ids, 8)


def assert_ranks_give_transformers_logits_and_greedy_ids(per_rank: list[dict], family: str, hf_dir: str,
                                                         ids: torch.Tensor, new_tokens: int) -> None:
    """Every rank's (logits of `ids`, `new_tokens` greedy ids) of `family` (_ep2_tp2's) equal transformers' on
    `hf_dir`, its greedy ids taken with the sequence recomputed each step as ours are."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokens = ids
    with torch.no_grad():
        reference = hf_model(ids).logits
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, hf_model(tokens).logits[:, -1:].argmax(-1)], dim=1)
    for rank, ranks_results in enumerate(per_rank):
        logits, greedy = ranks_results[family]
        assert_close_relative(logits, reference, rel=1e-4, msg=f"{family} rank {rank}")
        assert torch.equal(greedy, tokens[:, ids.shape[1]:]), f"{family} rank {rank}"


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_to_mlite_to_hf_is_tensor_identical(converted, family, tmp_path):
    hf_dir, mlite_dir = converted[family]
    convert("--direction", "mlite-to-hf", "--load-dir", mlite_dir, "--save-dir", str(tmp_path / "back"))
    assert_same_safetensors(hf_dir, str(tmp_path / "back"))
    before, after = read_json(os.path.join(hf_dir, "config.json")), read_json(tmp_path / "back/config.json")
    assert {k: v for k, v in after.items() if k in before and k != "dtype"} == \
           {k: v for k, v in before.items() if k in after and k != "dtype"}
    assert os.path.exists(tmp_path / "back/generation_config.json")


def assert_same_safetensors(hf_dir: str, other_dir: str) -> None:
    """The two directories' model.safetensors hold the same names, dtypes and values."""
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    back = load_file(os.path.join(other_dir, "model.safetensors"))
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_sharded_export_loads_in_transformers_and_converts_back(converted, tmp_path):
    hf_dir, mlite_dir = converted["llama"]
    convert("--direction", "mlite-to-hf", "--load-dir", mlite_dir, "--save-dir", str(tmp_path / "hf"),
            "--max-shard-size", "100KB")
    index = read_json(tmp_path / "hf/model.safetensors.index.json")
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all(os.path.getsize(tmp_path / "hf" / f) < 100_000 + 64 * 300 * 4 for f in files)
    assert os.path.exists(tmp_path / "hf/tokenizer.json")
    ids = torch.randint(0, HF_VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(hf_logits(str(tmp_path / "hf"), ids), hf_logits(hf_dir, ids), rtol=0, atol=0)
    convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "again"))
    first = read_checkpoint_tensors(resolve_checkpoint(mlite_dir))
    again = read_checkpoint_tensors(resolve_checkpoint(str(tmp_path / "again")))
    assert sorted(first) == sorted(again) and all(torch.equal(first[k], again[k]) for k in first)


# -------------------------------------------------------------------------------------------------------
# Checkpoints trained here -> transformers

OURS = {
    "llama": {"model_preset": "llama-tiny", "untie_embeddings_and_output_weights": False, "ffn_hidden_size": 128},
    "gpt2": {"model_preset": "gpt2-124m", "ffn_hidden_size": 256, "hidden_dropout": 0.0, "attention_dropout": 0.0,
             "num_query_groups": None},
    "mixtral": {"model_preset": "mixtral-tiny", "ffn_hidden_size": 64, "num_experts": 4},
    "qwen2_moe": {"model_preset": "mixtral-tiny", "ffn_hidden_size": 64, "num_experts": 4, "add_qkv_bias": True,
                  "moe_router_pre_softmax": True, "moe_shared_expert_intermediate_size": 96,
                  "moe_shared_expert_gate": True},
}


@pytest.mark.parametrize("family", list(OURS))
def test_trained_checkpoint_exports_to_transformers_with_our_logits(family, tmp_path):
    config = make_config({"mock_data": True, "vocab_size": HF_VOCAB, "num_layers": 2, "hidden_size": 64,
                          "num_attention_heads": 4, "num_query_groups": 2, "seq_length": SEQ,
                          "max_position_embeddings": SEQ, "train_iters": 2, "global_batch_size": 2, "lr": 1e-2,
                          "save": str(tmp_path / "run"), "log_interval": 1000, "eval_interval": 1000, "device": "cpu",
                          **OURS[family]})
    pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.forward_step)
    with open(tmp_path / "run/generation_config.json", "w") as f:  # generation defaults beside the checkpoint
        json.dump({"bos_token_id": 5, "eos_token_id": 6}, f)
    convert("--direction", "mlite-to-hf", "--load-dir", str(tmp_path / "run"), "--save-dir", str(tmp_path / "hf"))
    exported = read_json(tmp_path / "hf/config.json")
    assert exported["model_type"] == family and (exported["bos_token_id"], exported["eos_token_id"]) == (5, 6)
    if family == "llama":  # tied embeddings: no lm_head, as save_pretrained writes them
        assert exported["tie_word_embeddings"] and "lm_head.weight" not in load_file(tmp_path / "hf/model.safetensors")
    ids = torch.randint(0, HF_VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    assert_close_relative(hf_logits(str(tmp_path / "hf"), ids), our_logits(str(tmp_path / "run"), ids), rel=1e-4)


# -------------------------------------------------------------------------------------------------------
# Bad input


def _copy_hf(converted, tmp_path, family="llama", **config_changes) -> str:
    target = str(tmp_path / "edited")
    shutil.copytree(converted[family][0], target)
    edit_json(os.path.join(target, "config.json"), lambda config: config.update(config_changes))
    return target


def _copy_mlite(converted, tmp_path, **model_changes) -> str:
    """The converted llama checkpoint with its saved model configuration changed."""
    target = str(tmp_path / "mlite")
    shutil.copytree(converted["llama"][1], target)
    edit_json(os.path.join(resolve_checkpoint(target), "metadata.json"),
              lambda saved: saved["config"]["model"].update(model_changes))
    return target


def test_unknown_architecture_is_one_line_listing_supported_types(converted, tmp_path):
    source = _copy_hf(converted, tmp_path, model_type="bert")
    message = one_line_error("--direction", "hf-to-mlite", "--load-dir", source, "--save-dir", str(tmp_path / "out"))
    assert "unsupported model_type 'bert'" in message and "llama, qwen2, qwen3, gpt2, mixtral" in message
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--direction", "hf-to-mlite", "--load-dir",
                             source, "--save-dir", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == message, result.stderr


def test_missing_weights_file_is_one_line(converted, tmp_path):
    source = _copy_hf(converted, tmp_path)
    os.remove(os.path.join(source, "model.safetensors"))
    message = one_line_error("--direction", "hf-to-mlite", "--load-dir", source, "--save-dir", str(tmp_path / "out"))
    assert "no weights file" in message and "model.safetensors" in message
    convert("--direction", "mlite-to-hf", "--load-dir", converted["gpt2"][1], "--save-dir", str(tmp_path / "sharded"),
            "--max-shard-size", "100KB")
    shard = sorted(set(read_json(tmp_path / "sharded/model.safetensors.index.json")["weight_map"].values()))[1]
    os.remove(tmp_path / "sharded" / shard)
    message = one_line_error("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "sharded"), "--save-dir",
                             str(tmp_path / "out"))
    assert shard in message and "missing" in message
    message = one_line_error("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "nowhere"), "--save-dir",
                             str(tmp_path / "out"))
    assert "not a local directory" in message


def test_mismatched_shapes_are_one_line(converted, tmp_path):
    source = _copy_hf(converted, tmp_path, intermediate_size=128)
    message = one_line_error("--direction", "hf-to-mlite", "--load-dir", source, "--save-dir", str(tmp_path / "out"))
    assert "'model.layers.0.mlp.gate_proj.weight' has shape (96, 64) but the configuration implies (128, 64)" in message
    exported = _copy_mlite(converted, tmp_path, num_query_groups=4)
    message = one_line_error("--direction", "mlite-to-hf", "--load-dir", exported, "--save-dir", str(tmp_path / "hf"))
    assert "'decoder.layers.0.self_attention.linear_qkv.weight' has shape (128, 64) but the configuration implies " \
           "(192, 64)" in message


def test_unsupported_variants_and_targets_are_one_line(converted, tmp_path):
    source = _copy_hf(converted, tmp_path, rope_scaling={"rope_type": "yarn", "factor": 8.0})
    assert "RoPE scaling (yarn)" in one_line_error("--direction", "hf-to-mlite", "--load-dir", source, "--save-dir",
                                            str(tmp_path / "out"))
    message = one_line_error("--direction", "hf-to-mlite", "--load-dir", converted["llama"][0], "--save-dir",
                             str(tmp_path / "out"), "--target-tensor-parallel-size", "3")
    assert "at TP3 x PP1" in message and "num-attention-heads (4) must be divisible by tensor-model-parallel-size (3)" \
        in message
    message = one_line_error("--direction", "hf-to-mlite", "--load-dir", converted["llama"][0], "--save-dir",
                             converted["gpt2"][1])
    assert "is not empty" in message
    exported = _copy_mlite(converted, tmp_path, normalization="LayerNorm")
    message = one_line_error("--direction", "mlite-to-hf", "--load-dir", exported, "--save-dir", str(tmp_path / "hf"))
    assert "no Hugging Face model type has this network" in message


def test_a_failed_conversion_leaves_nothing_in_the_save_dir_and_runs_again(tmp_path, monkeypatch):
    """A disk that fills while the checkpoint is written fails the conversion; --save-dir is left as it was (here:
    absent), so the same command, once there is room, converts."""
    import errno

    import transformers

    from megatron_lite.hf import checkpoint
    from tests.helpers import convert, hf_config

    hf_dir, save_dir = tmp_path / "hf", tmp_path / "mlite"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_config("llama")).save_pretrained(hf_dir)
    write = checkpoint.write_model_checkpoint

    def disk_fills(root, *args, **kwargs):
        os.makedirs(os.path.join(root, "iter_0000000.tmp"), exist_ok=True)
        with open(os.path.join(root, "iter_0000000.tmp", "__0_0.distcp"), "wb") as f:
            f.write(b"\0" * 1024)
        raise OSError(errno.ENOSPC, "No space left on device", f.name)

    monkeypatch.setattr(checkpoint, "write_model_checkpoint", disk_fills)
    with pytest.raises(SystemExit, match="convert_checkpoint.py: error: .*No space left on device"):
        convert("--direction", "hf-to-mlite", "--load-dir", str(hf_dir), "--save-dir", str(save_dir))
    assert not save_dir.exists()
    monkeypatch.setattr(checkpoint, "write_model_checkpoint", write)
    convert("--direction", "hf-to-mlite", "--load-dir", str(hf_dir), "--save-dir", str(save_dir))
    assert (save_dir / "latest_checkpointed_iteration.txt").exists()
