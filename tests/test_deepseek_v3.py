"""DeepSeek-V3's stack beyond attention: --moe-layer-freq in Megatron's forms (dense first layers with their own
FFN size, counted apart by the planner), the deepseek-v3 and moonlight-16b presets against the published configs
and parameter counts, the deepseek_v3 config.json both ways, and transformers' logits from a converted checkpoint
loaded at TP2 x PP2 x EP2. (Logits, greedy ids, TP2 x PP2 and EP2 x TP2 loads and the tensor-identical round trip
of random DeepseekV3ForCausalLM models are test_hf_conversion.py's and test_generation.py's deepseek_v3 families;
multi-latent attention itself is test_mla.py's.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import pretrain_gpt
from megatron_lite.checkpoint.checkpointing import Checkpointer
from megatron_lite.config.arguments import make_config
from megatron_lite.config.layer_pattern import moe_layer_pattern
from megatron_lite.config.presets import MODEL_PRESETS
from megatron_lite.errors import ConfigError
from megatron_lite.hf.families import hf_config_from_model, model_values_from_hf
from megatron_lite.hf.weights import hf_shapes
from megatron_lite.model.gpt import GPTModel
from megatron_lite.model.mlp import MLP
from megatron_lite.model.moe.layer import MoELayer
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.loop import build_model, initialize
from tests.harness import run_on_ranks
from tests.helpers import HF_VOCAB, hf_models
from tests.test_hf_conversion import _forward_logits as forward_logits
from tests.test_mla import MLA
from tests.test_plan_layout import built_and_planned
from tests.tolerances import assert_close_relative

# deepseek-ai/DeepSeek-V3 and moonshotai/Moonlight-16B-A3B config.json (the keys that shape the network)
_COMMON = {"model_type": "deepseek_v3", "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
           "norm_topk_prob": True, "scoring_func": "sigmoid", "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "kv_lora_rank": 512, "initializer_range": 0.02}
PUBLISHED = {
    "deepseek-v3": {**_COMMON, "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
                    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "q_lora_rank": 1536,
                    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
                    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "moonlight-16b": {**_COMMON, "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
                      "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
                      "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446,
                      "q_lora_rank": None, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
                      "first_k_dense_replace": 1, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                      "rope_theta": 50000.0, "rope_scaling": None},
}
# (total, activated, whether the figures count the embeddings): DeepSeek-V3's report gives 671B and 37B; the
# Moonlight report 15.29B and 2.24B without embeddings. The totals below are transformers' counts of the configs
# above (parameters and the expert biases its checkpoints hold), the published totals to their rounding.
COUNTS = {"deepseek-v3": (671_026_419_200, 37e9, True), "moonlight-16b": (15_960_110_208, 2.24e9, False)}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_has_the_published_shapes_and_parameter_counts(preset):
    published = model_values_from_hf(PUBLISHED[preset])
    for key, value in MODEL_PRESETS[preset].items():
        if key in published and key not in ("seq_length", "norm_epsilon"):
            assert published[key] == value, key
    m = make_config({"model_preset": preset, "mock_data": True}).model
    shapes = {name: torch.Size(shape).numel() for name, shape in hf_shapes("deepseek_v3", m).items()}
    total, activated, with_embeddings = COUNTS[preset]
    assert sum(shapes.values()) == total
    routed = sum(n for name, n in shapes.items() if ".mlp.experts." in name)
    embeddings = sum(n for name, n in shapes.items() if name in ("model.embed_tokens.weight", "lm_head.weight"))
    counted = sum(shapes.values()) - routed * (1 - m.moe_router_topk / m.num_experts)
    counted -= 0 if with_embeddings else embeddings
    assert counted == pytest.approx(activated, rel=0.02)  # the published figure's rounding
    if not with_embeddings:
        assert round((total - embeddings) / 1e9, 2) == 15.29


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_config_json_round_trips(preset):
    m = make_config({"model_preset": preset, "mock_data": True}).model
    values = model_values_from_hf(hf_config_from_model(m, torch.bfloat16))
    rebuilt = make_config({**values, "mock_data": True, "seq_length": m.seq_length,
                           "moe_router_load_balancing_type": m.moe_router_load_balancing_type,
                           "moe_aux_loss_coeff": m.moe_aux_loss_coeff,
                           "moe_router_bias_update_rate": m.moe_router_bias_update_rate}).model
    assert moe_layer_pattern(rebuilt) == moe_layer_pattern(m)
    for field in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                  "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_original_max_position_embeddings",
                  "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                  "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk", "ffn_hidden_size",
                  "norm_epsilon", "rotary_base", "vocab_size", "num_layers", "hidden_size"):
        assert getattr(rebuilt, field) == getattr(m, field), field


@pytest.mark.parametrize(("freq", "pattern"), [
    (1, [1, 1, 1, 1]), (2, [1, 0, 1, 0]), ("3", [1, 0, 0, 1]), ("([0]*2+[1]*2)", [0, 0, 1, 1]),
    ("([1]*1+[0]*1)*2", [1, 0, 1, 0]), ([0, 1, 1, 0], [0, 1, 1, 0]),
])
def test_moe_layer_freq_takes_megatrons_forms(freq, pattern):
    m = make_config({**MLA, "num_layers": 4, "num_experts": 4, "moe_ffn_hidden_size": 32, "moe_layer_freq": freq}).model
    assert moe_layer_pattern(m) == [bool(p) for p in pattern]


def test_dense_first_layers_have_their_own_ffn_size():
    config = make_config({**MLA, "num_layers": 4, "num_experts": 4, "moe_ffn_hidden_size": 32,
                          "ffn_hidden_size": 80, "moe_layer_freq": "([0]*2+[1]*2)"})
    pstate = ParallelState.single()
    model = GPTModel(config.model, pstate, padded_vocab=config.model.vocab_size, seed=1)
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [MLP, MLP, MoELayer, MoELayer]
    assert model.decoder.layers[0].mlp.linear_fc2.weight.shape == (64, 80)
    experts = dict(model.decoder.layers[2].mlp.named_parameters())
    assert experts["experts.0.linear_fc2.weight"].shape == (64, 32)


@pytest.mark.parametrize(("freq", "message"), [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("[0]*3", "the pattern has 3 entries for 4 layers"),
    ("[2]*4", "may hold only 0 and 1"),
    ("[1]*100000*100000", "more than any model has"),
    ("0", "the frequency (0) must be at least 1"),
    ("[0,1", "is neither an integer nor a list expression"),
])
def test_a_bad_moe_layer_freq_is_one_line(freq, message):
    with pytest.raises(ConfigError) as error:
        make_config({**MLA, "num_layers": 4, "num_experts": 4, "moe_layer_freq": freq})
    assert message in str(error.value) and "\n" not in str(error.value)


PLANNED = {**MLA, "num_layers": 4, "num_experts": 4, "moe_ffn_hidden_size": 32, "ffn_hidden_size": 80,
           "moe_layer_freq": "([0]*1+[1]*3)", "moe_shared_expert_intermediate_size": 32, "micro_batch_size": 1,
           "global_batch_size": 8, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}
PLANNED_LAYOUTS = {"tp2_ep2_zero1": {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                     "use_distributed_optimizer": True},
                   "pp2_ep2_bf16": {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2, "bf16": True}}


def _built_and_planned_layouts() -> dict:
    return {name: built_and_planned({**PLANNED, **flags}, 4) for name, flags in PLANNED_LAYOUTS.items()}


def test_planned_state_bytes_of_latent_attention_and_dense_first_layers_equal_the_built_model():
    for rank, results in enumerate(run_on_ranks(4, _built_and_planned_layouts)):
        for name, result in results.items():
            assert result["planned"] == result["built"], f"{name} rank {rank}"


def _tp2_pp2_ep2_logits(mlite_dir: str, flags: dict, ids: torch.Tensor):
    """Logits of `ids` after loading a converted checkpoint at TP2 x PP2 x EP2 over DP2 (as --load does)."""
    config = make_config({**flags, "mock_data": True, "seq_length": ids.shape[1], "tensor_model_parallel_size": 2,
                          "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2, "load": mlite_dir,
                          "finetune": True, "micro_batch_size": 2, "global_batch_size": 4, "device": "cpu"}, 8)
    pstate, device = initialize(config)
    model = build_model(config, pstate, pretrain_gpt.model_provider, device)
    Checkpointer(config, pstate, device).load_checkpoint(model, None)
    for chunk in model:
        chunk.eval()
    return forward_logits(config, model, pstate, ids)


def test_converted_deepseek_v3_at_tp2_pp2_ep2_gives_transformers_logits(tmp_path_factory):
    """Heads split over TP, 2 dense + 2 MoE layers over two pipeline stages, experts over two expert-parallel
    ranks: the last stage's logits equal transformers'."""
    from transformers import AutoModelForCausalLM

    hf_dir, mlite_dir = hf_models(tmp_path_factory)["deepseek_v3"]
    flags = yaml.safe_load((Path(mlite_dir) / "model.yaml").read_text())
    ids = torch.randint(0, HF_VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    last_stages = [logits for logits in run_on_ranks(8, _tp2_pp2_ep2_logits, mlite_dir, flags, ids)
                   if logits is not None]
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(ids).logits
    assert len(last_stages) == 4  # the last stage's TP x DP ranks
    for logits in last_stages:
        assert_close_relative(logits, reference, rel=1e-4)


def _with_published_mtp_module(hf_dir: str, target: Path) -> dict:
    """A copy of a transformers-saved DeepseekV3 directory with one multi-token prediction module stored as DeepSeek
    publishes it (layer num_hidden_layers: its norms, eh_proj, shared_head and a copy of the embedding, then an
    MoE transformer layer under the decoder layers' names), random except the copies; returns the tensors."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, target)
    config = json.loads((target / "config.json").read_text())
    last, module = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    tensors = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    prefix = f"model.layers.{last}."
    for name, tensor in list(tensors.items()):
        if name.startswith(prefix):
            tensors[f"model.layers.{module}." + name[len(prefix):]] = torch.randn(tensor.shape, generator=generator)
    h = config["hidden_size"]
    mtp = f"model.layers.{module}."
    tensors |= {mtp + "enorm.weight": torch.rand(h, generator=generator) + 0.5,
                mtp + "hnorm.weight": torch.rand(h, generator=generator) + 0.5,
                mtp + "eh_proj.weight": torch.randn(h, 2 * h, generator=generator) * 0.02,
                mtp + "shared_head.norm.weight": torch.rand(h, generator=generator) + 0.5,
                mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (target / "config.json").write_text(json.dumps(config))
    return tensors


def test_a_published_mtp_module_converts_into_an_moe_mtp_layer_and_back_tensor_identical(tmp_path_factory, tmp_path):
    """DeepSeek-V3's multi-token prediction module is an MoE layer stored after the decoder's: converted, it is our
    mtp.layers.0 with routed experts under global names; back, every tensor is the original bit for bit; a module's
    copy of the embedding that differs from the model's is one line."""
    from safetensors.torch import load_file, save_file

    from tests.helpers import convert

    hf_dir, _ = hf_models(tmp_path_factory)["deepseek_v3"]
    original = _with_published_mtp_module(hf_dir, tmp_path / "hf")
    convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "mlite"))
    flags = yaml.safe_load((tmp_path / "mlite" / "model.yaml").read_text())
    assert flags["mtp_num_layers"] == 1
    config = make_config({**flags, "mock_data": True})
    model = GPTModel(config.model, ParallelState.single(), padded_vocab=HF_VOCAB, seed=1)
    names = dict(model.named_global_parameters())
    assert isinstance(model.mtp.layers[0].transformer_layer.mlp, MoELayer)
    assert "mtp.layers.0.transformer_layer.mlp.experts.3.linear_fc1.weight" in names
    convert("--direction", "mlite-to-hf", "--load-dir", str(tmp_path / "mlite"), "--save-dir", str(tmp_path / "back"))
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor.to(back[name].dtype)), name
    module = json.loads((tmp_path / "hf" / "config.json").read_text())["num_hidden_layers"]
    original[f"model.layers.{module}.embed_tokens.weight"] += 1.0
    save_file(original, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SystemExit):
        convert("--direction", "hf-to-mlite", "--load-dir", str(tmp_path / "hf"), "--save-dir", str(tmp_path / "bad"))


def test_the_deepseek_v3_mtp_module_adds_its_published_shapes():
    """DeepSeek-V3's multi-token prediction module, counted from the published shapes: an MoE layer with multi-latent
    attention (q latent 1536, KV latent 512 + RoPE key 64, 128 heads of 128 + 64 / 128), 256 routed experts of 2048,
    one shared expert, the router with its bias and two norms, plus enorm, hnorm, eh_proj [h, 2h], the final norm,
    and copies of the embedding and output layer: 13.5B on top of the 671B (the model card's 685B also counts the
    FP8 weights' block scales)."""
    h, vocab, heads = 7168, 129280, 128
    attention = (h * 1536 + 1536 + 1536 * heads * (128 + 64) + h * (512 + 64) + 512 + 512 * heads * (128 + 128)
                 + heads * 128 * h)
    layer = attention + 256 * 3 * h * 2048 + 3 * h * 2048 + 256 * h + 256 + 2 * h
    module = layer + 2 * h + 2 * h * h + h + 2 * vocab * h
    m = make_config({"model_preset": "deepseek-v3", "mock_data": True, "mtp_num_layers": 1}).model
    total = sum(torch.Size(shape).numel() for shape in hf_shapes("deepseek_v3", m).values())
    assert total - COUNTS["deepseek-v3"][0] == module == 13_463_426_304
