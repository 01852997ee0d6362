"""Attention kernels: the backend choice, the SDPA kernel that actually runs, no silent math fallback on
CUDA, and torch's CUDA attention ops used as context-parallel block kernels (those tests need a GPU)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lite.config.arguments import make_config
from megatron_lite.model.attention import self_attention as attention
from megatron_lite.model.attention.context_parallel import CudaEfficientKernel, CudaFlashKernel
from megatron_lite.model.attention.self_attention import CoreAttention, choose_attention_backend, sdpa_kernel_name
from tests.tolerances import assert_close_relative

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FUSED_CUDA_OPS = {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention"}


def test_sdpa_is_the_default_and_flash_attn_only_when_asked(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(attention, "flash_attn_func", object())  # as if flash-attn were installed
    assert choose_attention_backend("auto", cuda) == "sdpa"
    assert choose_attention_backend("sdpa", cuda) == "sdpa"
    assert choose_attention_backend("flash", cuda) == "flash"
    with pytest.raises(RuntimeError, match="CUDA device"):
        choose_attention_backend("flash", cpu)
    monkeypatch.setattr(attention, "flash_attn_func", None)
    with pytest.raises(RuntimeError, match="flash-attn package"):
        choose_attention_backend("flash", cuda)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_kernel_on_cpu_is_the_cpu_flash_kernel_for_the_model_shapes(dtype):
    model = make_config({"model_preset": "llama-tiny", "mock_data": True}).model
    name = sdpa_kernel_name(2, 128, model.num_attention_heads, model.num_query_groups, model.head_dim, dtype, "cpu")
    assert name == "_scaled_dot_product_flash_attention_for_cpu"


def test_sdpa_kernel_name_reports_the_math_fallback():
    """SDPA on CPU has no fused kernel with dropout: the report says so rather than naming a fused kernel."""
    assert sdpa_kernel_name(1, 32, 2, 2, 8, torch.float32, "cpu", dropout=0.1) == "_scaled_dot_product_attention_math"


FUSED = {"cudnn", "flash", "efficient"}


@pytest.mark.parametrize("device, dtype, enabled, kv_heads", [
    ("cuda", torch.bfloat16, FUSED, 2), ("cuda", torch.float16, FUSED, 2), ("cuda", torch.float32, {"efficient"}, 4),
    ("cpu", torch.bfloat16, FUSED | {"math"}, 2), ("cpu", torch.float32, FUSED | {"math"}, 2),
])
def test_core_attention_never_lets_cuda_fall_back_to_math(device, dtype, enabled, kv_heads, monkeypatch):
    """CoreAttention calls SDPA on CUDA with fused kernels only: in bf16/fp16 any of them with the key/value heads
    shared (enable_gqa); in fp32 the memory-efficient kernel alone, the only fused one for fp32, which refuses
    enable_gqa, so K/V come repeated to the query heads. On the CPU SDPA chooses freely. Fake CUDA tensors stand
    in for a GPU; SDPA is replaced by a probe that records the enabled backends and the key heads it got."""
    seen = []
    flags = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled, "flash": torch.backends.cuda.flash_sdp_enabled,
             "efficient": torch.backends.cuda.mem_efficient_sdp_enabled, "math": torch.backends.cuda.math_sdp_enabled}

    def probe(q, k, v, **kwargs):
        seen.append(({name for name, on in flags.items() if on()}, k.shape[1], v.shape[1]))
        return torch.empty_like(q)

    monkeypatch.setattr(F, "scaled_dot_product_attention", probe)
    with FakeTensorMode():
        q = torch.empty(16, 2, 4, 8, device=device, dtype=dtype)
        k = v = torch.empty(16, 2, 2, 8, device=device, dtype=dtype)
    CoreAttention(0.0, "sdpa", rng_tracker=None)(q, k, v)
    assert seen == [(enabled, kv_heads, kv_heads)]
    assert torch.backends.cuda.math_sdp_enabled()  # restored after the call


def test_repeated_key_value_heads_give_grouped_query_attention():
    """Query head i attends with key/value head i // (heads / groups) either way: the fp32 CUDA path's repeated
    K/V against SDPA's enable_gqa, on the CPU."""
    torch.manual_seed(0)
    q = torch.randn(2, 6, 16, 8)
    k, v = torch.randn(2, 3, 16, 8), torch.randn(2, 3, 16, 8)
    grouped = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    per_head = [F.scaled_dot_product_attention(q[:, i:i + 1], k[:, i // 2:i // 2 + 1], v[:, i // 2:i // 2 + 1],
                                               is_causal=True) for i in range(6)]
    k_repeated, v_repeated = attention.SdpaPlan(None, repeat_kv=True).key_values(q, k, v)
    assert k_repeated.shape == v_repeated.shape == (2, 6, 16, 8)
    repeated = F.scaled_dot_product_attention(q, k_repeated, v_repeated, is_causal=True)
    assert_close_relative(repeated, torch.cat(per_head, dim=1))
    assert_close_relative(grouped, torch.cat(per_head, dim=1))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_on_cuda_runs_a_fused_kernel_in_half_precision(dtype):
    """Llama-3.2-1B's attention shapes (32 heads, 8 groups, head_dim 64)."""
    assert sdpa_kernel_name(1, 1024, 32, 8, 64, dtype, "cuda") in FUSED_CUDA_OPS


def reference_block(q, k, v, causal: bool):
    """fp32 attention of a block with explicit scores: out [b, sq, nh, d], lse [b, nh, sq] (GQA)."""
    groups = q.shape[2] // k.shape[2]
    q, k, v = q.float().transpose(1, 2), *(t.float().transpose(1, 2).repeat_interleave(groups, 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    lse = scores.logsumexp(-1)
    return ((scores - lse.unsqueeze(-1)).exp() @ v).transpose(1, 2), lse


@pytest.mark.parametrize("kernel, dtype", [(CudaFlashKernel, torch.bfloat16), (CudaEfficientKernel, torch.float32)])
@pytest.mark.parametrize("sq, sk, causal", [(128, 128, True), (48, 128, False)])
def test_cuda_block_kernels_fit_the_torch_op_schemas(kernel, dtype, sq, sk, causal):
    """Without a GPU: on meta tensors (the ops' shape functions) torch's CUDA attention ops accept the
    block kernels' arguments, and the results have the block layouts: out [b, sq, nh, d] in the input
    dtype, lse [b, nh, sq] fp32, gradients shaped like q, k, v (GQA)."""
    q = torch.empty(2, sq, 4, 64, dtype=dtype, device="meta")
    k = v = torch.empty(2, sk, 2, 64, dtype=dtype, device="meta")
    out, lse = kernel.forward(q, k, v, causal, 0.125)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, dtype, (2, 4, sq), torch.float32)
    grads = kernel.backward(out, q, k, v, out, lse, causal, 0.125)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@needs_cuda
@pytest.mark.parametrize("kernel, dtype, rel", [(CudaFlashKernel, torch.bfloat16, 2e-2),
                                                (CudaEfficientKernel, torch.float32, 1e-3)])
@pytest.mark.parametrize("sq, sk, causal", [(128, 128, True), (48, 128, False)])
def test_cuda_block_kernels_return_the_lse_and_take_it_back(kernel, dtype, rel, sq, sk, causal):
    """A block's output, LSE and q/k/v gradients (given its own output and LSE) equal fp32 attention with
    explicit scores, with GQA; 48 query rows exercise the efficient kernel's padded LSE."""
    generator = torch.Generator().manual_seed(0)
    b, nh, ng, d = 2, 4, 2, 64
    q, k, v = (torch.randn(b, s, n, d, generator=generator).to("cuda", dtype).requires_grad_()
               for s, n in ((sq, nh), (sk, ng), (sk, ng)))
    dout = torch.randn(b, sq, nh, d, generator=generator).to("cuda", dtype)
    reference_out, reference_lse = reference_block(q, k, v, causal)
    reference_out.backward(dout.float())
    with torch.no_grad():
        out, lse = kernel.forward(q, k, v, causal, d ** -0.5)
        grads = kernel.backward(dout, q, k, v, out, lse, causal, d ** -0.5)
    assert_close_relative(out.float(), reference_out.detach(), rel=rel)
    assert_close_relative(lse, reference_lse.detach(), rel=rel)
    for grad, tensor in zip(grads, (q, k, v)):
        assert grad.shape == tensor.shape
        assert_close_relative(grad.float(), tensor.grad.float(), rel=rel)
