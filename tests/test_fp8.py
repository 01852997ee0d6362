"""FP8 training (--fp8-format, --fp8-recipe): scaled FP8 GEMMs in the transformer layers' linears.

One FP8 linear's forward, input gradient and weight gradient equal a quantize -> dequantize -> matmul
reference written here from the recipes' definitions (Transformer Engine's current scaling: scale =
fp8_max / amax / 2^margin; tensorwise one amax per tensor, rowwise one per slice along the GEMM's contraction;
hybrid: e5m2 gradients), per recipe and format. FP8 at TP2+SP, CP2, PP2, DP2 and ZeRO-1/3 trains as one process
with FP8; a recipe that is not built, or FP8 with fp16, is one line.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.config.arguments import ConfigError, make_config
from megatron_lite.model.fp8 import FP8Recipe, GemmSplits, fp8_linear, quantize, scaled_gemm
from tests.harness import run_on_ranks
from tests.helpers import TINY_2_LAYERS, build_run, losses_and_norms
from tests.tolerances import assert_close_relative

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def dequantized(t: torch.Tensor, dtype: torch.dtype, margin: int, dim: int | None) -> torch.Tensor:
    """t as its FP8 quantization represents it (fp32): scaled so that the amax (of the whole tensor, or of
    each slice along `dim`) maps to fp8_max / 2^margin, rounded to `dtype`, scaled back."""
    t = t.double()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    fp8_max = torch.finfo(dtype).max
    scale = (fp8_max / amax / 2.0**margin).float().double()
    return ((t * scale).float().clamp(-fp8_max, fp8_max).to(dtype).double() / scale)


def reference_gemms(x, w, dy, fmt: str, recipe: str, margin: int):
    """Y = X W^T, dX = dY W, dW = dY^T X with each operand quantized along its GEMM's contraction (rowwise) or
    whole (tensorwise); float64 products."""
    gradient = E5M2 if fmt == "hybrid" else E4M3
    rowwise = recipe == "rowwise"
    y = dequantized(x, E4M3, margin, 1 if rowwise else None) @ dequantized(w, E4M3, margin, 1 if rowwise else None).t()
    dx = dequantized(dy, gradient, margin, 1 if rowwise else None) @ dequantized(w, E4M3, margin,
                                                                                  0 if rowwise else None)
    dw = dequantized(dy, gradient, margin, 0 if rowwise else None).t() @ dequantized(x, E4M3, margin,
                                                                                      0 if rowwise else None)
    return y, dx, dw


CASES = [("e4m3", "tensorwise", 0), ("hybrid", "tensorwise", 0), ("e4m3", "rowwise", 0), ("hybrid", "rowwise", 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,recipe,margin", CASES)
def test_fp8_linear_forward_and_both_gradients_equal_quantize_dequantize_matmul(fmt, recipe, margin, dtype):
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 4, 48, generator=generator) * torch.linspace(0.1, 3, 48)).to(dtype).requires_grad_()
    w = (torch.randn(80, 48, generator=generator) * 0.05).to(dtype).requires_grad_()
    dy = torch.randn(6, 4, 80, generator=generator).to(dtype)
    y = fp8_linear(x, w, None, FP8Recipe(fmt, recipe, margin), GemmSplits())
    y.backward(dy)
    ref_y, ref_dx, ref_dw = reference_gemms(x.detach().reshape(24, 48), w.detach(), dy.reshape(24, 80), fmt, recipe,
                                            margin)
    rel = max(torch.finfo(dtype).eps, 1e-5)  # the output dtype's rounding (fp32: of sums in another order)
    for name, actual, expected in (("y", y.reshape(24, 80), ref_y), ("dx", x.grad.reshape(24, 48), ref_dx),
                                   ("dw", w.grad, ref_dw)):
        assert actual.dtype == dtype, name
        assert_close_relative(actual.double(), expected.to(dtype).double(), rel=rel, msg=name)
    exact = x.detach().double().reshape(24, 48) @ w.detach().double().t()
    with pytest.raises(AssertionError):  # quantization happened: the exact product is further away than rounding
        assert_close_relative(y.reshape(24, 80).double(), exact, rel=rel)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,recipe,margin", CASES)
def test_the_exact_cpu_gemm_equals_torch_scaled_mm(fmt, recipe, margin, out_dtype):
    generator = torch.Generator().manual_seed(1)
    left_dtype = E5M2 if fmt == "hybrid" else E4M3
    a = torch.randn(24, 64, generator=generator) * torch.linspace(0.01, 4, 64)
    b = torch.randn(64, 40, generator=generator) * 0.05
    fp8_recipe = FP8Recipe(fmt, recipe, margin)
    dim = None if recipe == "tensorwise" else 1
    a_fp8, a_inverse = quantize(a, left_dtype, margin, dim, ())
    b_t_fp8, b_t_inverse = quantize(b.t().contiguous(), E4M3, margin, dim, ())
    b_fp8, b_inverse = b_t_fp8.t(), (b_t_inverse if dim is None else b_t_inverse.t())
    expected = torch._scaled_mm(a_fp8, b_fp8, scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype)
    actual = scaled_gemm(a_fp8, a_inverse, b_fp8, b_inverse, fp8_recipe, out_dtype)
    assert actual.dtype == out_dtype
    # fp32 sums of exact products in another order; bf16 output: one rounding of nearly equal sums
    assert_close_relative(actual.double(), expected.double(), rel=max(torch.finfo(out_dtype).eps, 1e-5))


# ---------------------------------------------------------------------------------------------------
# The switch: which layers compute in FP8, the refused combinations, unchanged parameters

FP8_TINY = {**TINY_2_LAYERS, "train_iters": 2, "global_batch_size": 4, "attention_dropout": 0.0,
            "hidden_dropout": 0.0, "fp8_format": "hybrid"}


def fp8_of_linears(values: dict) -> dict[str, FP8Recipe | None]:
    config, _, _, model, _ = build_run(values, 1)
    return {name: module.fp8 for name, module in model[0].module.named_modules() if hasattr(module, "fp8")}


def test_fp8_reaches_every_attention_and_mlp_linear_and_not_the_output_layer_nor_kept_bf16_layers():
    values = {**FP8_TINY, "num_layers": 4, "first_last_layers_bf16": True, "num_layers_at_end_in_bf16": 2,
              "fp8_recipe": "rowwise", "fp8_margin": 1}
    linears = fp8_of_linears(values)
    recipe = FP8Recipe("hybrid", "rowwise", 1)
    projections = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    for layer in range(4):
        for projection in projections:
            expected = recipe if layer == 1 else None  # layer 0 kept by the start, 2 and 3 by the end
            assert linears.pop(f"decoder.layers.{layer}.{projection}") == expected, (layer, projection)
    assert linears == {"output_layer": None}


def test_fp8_adds_no_parameter_or_buffer_so_checkpoints_are_unchanged():
    def state_shapes(values):
        _, _, _, model, _ = build_run(values, 1)
        return {k: (v.shape, v.dtype) for k, v in model[0].module.state_dict().items()}

    plain = {k: v for k, v in FP8_TINY.items() if k != "fp8_format"}
    assert state_shapes(FP8_TINY) == state_shapes(plain)


@pytest.mark.parametrize("values,expected", [
    ({"fp8_recipe": "blockwise"}, "--fp8-recipe blockwise is not built; use tensorwise or rowwise"),
    ({"fp8_recipe": "mxfp8"}, "--fp8-recipe mxfp8 is not built"),
    ({"fp8_recipe": "delayed"}, "--fp8-recipe delayed is not built"),
    ({"fp16": True}, "--fp8-format does not go with --fp16"),
    ({"fp8_margin": -1}, "--fp8-margin (-1) must be 0 or more"),
    ({"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 3},
     "--num-layers-at-start-in-bf16 (3) must be between 0 and num-layers (2)"),
    ({"fp8_format": None, "first_last_layers_bf16": True}, "--first-last-layers-bf16 acts only with --fp8-format"),
    ({"num_layers": 4, "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 3,
      "num_layers_at_end_in_bf16": 3},
     "--num-layers-at-start-in-bf16 (3) + --num-layers-at-end-in-bf16 (3) cover all 4 layers, so no layer would run "
     "in FP8; lower them or drop --fp8-format"),
    ({"num_layers": 4, "first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 2,
      "num_layers_at_end_in_bf16": 2}, "cover all 4 layers"),
])
def test_unbuilt_fp8_combinations_are_one_line(values, expected):
    with pytest.raises(ConfigError) as error:
        make_config({**FP8_TINY, **values}, 1)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_an_unknown_fp8_format_is_refused_by_the_parser():
    from megatron_lite.config.arguments import parse_config
    with pytest.raises(ConfigError):
        parse_config(["--mock-data", "--fp8-format", "e5m2"], 1)


# ---------------------------------------------------------------------------------------------------
# Layout parity: FP8 scales are maxed over the groups that split a GEMM dimension

RECIPES = {"tensorwise_hybrid": {"fp8_recipe": "tensorwise", "fp8_format": "hybrid"},
           "rowwise_e4m3": {"fp8_recipe": "rowwise", "fp8_format": "e4m3"}}
LAYOUTS = {  # each on 4 ranks
    "tp2_sp_dp2_zero1": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                         "data_parallel_sharding_strategy": "optim"},
    "cp2_dp2_zero3": {"context_parallel_size": 2, "data_parallel_sharding_strategy": "optim_grads_params"},
    "pp2_dp2": {"pipeline_model_parallel_size": 2},
}


def train_fp8_layouts() -> dict:
    return {(recipe, layout): losses_and_norms({**FP8_TINY, **RECIPES[recipe], **LAYOUTS[layout]}, 4)
            for recipe in RECIPES for layout in LAYOUTS}


def test_fp8_at_tp2_sp_cp2_pp2_dp2_zero1_zero3_trains_as_one_process():
    references = {recipe: losses_and_norms({**FP8_TINY, **extra}, 1) for recipe, extra in RECIPES.items()}
    plain = losses_and_norms({k: v for k, v in FP8_TINY.items() if k != "fp8_format"}, 1)
    per_rank = run_on_ranks(4, train_fp8_layouts)
    for recipe, layout in per_rank[0]:
        for rank, history in enumerate(r[(recipe, layout)] for r in per_rank):
            assert len(history) == FP8_TINY["train_iters"]
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(history, references[recipe])):
                assert loss == pytest.approx(ref_loss, rel=1e-5), (recipe, layout, rank, step)
                assert norm == pytest.approx(ref_norm, rel=1e-5), (recipe, layout, rank, step)
    for recipe, reference in references.items():  # FP8 is on in the references: their figures are not fp32's
        assert [n for _, n in reference] != pytest.approx([n for _, n in plain], rel=1e-4), recipe
        assert [n for _, n in reference] == pytest.approx([n for _, n in plain], rel=5e-2), recipe


def test_the_planner_adds_the_widest_fp8_gemm_buffers_to_the_activation_peak():
    from megatron_lite.planning.activation_memory import stage_activation_bytes
    plain = make_config({k: v for k, v in FP8_TINY.items() if k != "fp8_format"}, 1)
    fp8 = make_config(FP8_TINY, 1)
    # fc1 is the widest: 32 tokens, 64 -> 2 x 128 (SwiGLU) features; its weight (16384 elements) in fp32 magnitude
    # (4 bytes) and fp32 scaled copy (4), the FP8 copies of X (32 x 64), dY (32 x 256) and W, and dY's transpose.
    expected = 16384 * (4 + 4) + (32 * 64 + 32 * 256 + 16384) + 32 * 256
    grown = stage_activation_bytes(fp8, 0, "no_pipelining").peak - stage_activation_bytes(plain, 0,
                                                                                          "no_pipelining").peak
    assert grown == expected
