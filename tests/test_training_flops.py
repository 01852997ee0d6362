"""The FLOPs behind TFLOP/s and MFU: model FLOPs as torch counts them, recomputation excluded, the right peak."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.config.arguments import make_config
from megatron_lite.model.flops import training_flops_per_token
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState
from megatron_lite.training.logging import peak_tflops_of

VOCAB = 1024


def tiny(preset: str, **values):
    return make_config({"model_preset": preset, "mock_data": True, "num_layers": 2, "hidden_size": 64,
                        "ffn_hidden_size": 96, "num_attention_heads": 4, "seq_length": 16,
                        "max_position_embeddings": 16, "vocab_size": VOCAB, "make_vocab_size_divisible_by": 1,
                        "hidden_dropout": 0.0, "attention_dropout": 0.0, **values}).model


@pytest.mark.parametrize(("preset", "extra"), [("llama-tiny", {}), ("gpt2-124m", {}),
                                             ("llama-tiny", {"kv_channels": 32, "qk_layernorm": True})])
def test_flops_per_token_are_the_matmuls_torch_counts(preset, extra):
    m = tiny(preset, **extra)
    model = GPTModel(m, ParallelState.single(), padded_vocab=VOCAB, seed=1)
    batch, seq = 2, m.seq_length
    ids = torch.randint(0, VOCAB, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(ids, torch.arange(seq), labels=ids).float().sum().backward()
    counted = counter.get_total_flops() / (batch * seq)
    heads_width = m.num_attention_heads * m.head_dim  # the hidden size unless --kv-channels says otherwise
    attention_square = 3 * m.num_layers * 4 * seq * heads_width  # QK^T and PV, forward + 2x backward
    attention_kernel_counted = any("attention" in str(op) for op in counter.get_flop_counts()["Global"])
    expected = counted if attention_kernel_counted else counted + attention_square
    assert training_flops_per_token(m) == pytest.approx(expected, rel=1e-12)


def test_recomputation_does_not_count_as_model_flops():
    assert training_flops_per_token(tiny("llama-tiny", recompute_granularity="full")) == \
        training_flops_per_token(tiny("llama-tiny"))


@pytest.mark.parametrize(("name", "peak"), [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                            ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
                                            ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                            ("NVIDIA GeForce GTX 1080", None)])
def test_peak_tflops_tell_h100_variants_and_h200_apart(name, peak):
    assert peak_tflops_of(name) == peak
