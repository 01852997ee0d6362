"""With the same weights, our logits equal transformers' GPT2LMHeadModel and LlamaForCausalLM (fp32)."""

import pytest
import torch
import transformers

from megatron_lite.config.arguments import make_config
from megatron_lite.data.tokenizers import padded_vocab_size
from megatron_lite.hf import weights
from megatron_lite.hf.checkpoint import load_into_model
from megatron_lite.model.gpt import GPTModel
from megatron_lite.parallel.state import ParallelState, TensorSplit
from tests.tolerances import assert_close_relative

VOCAB, SEQ = 300, 48


def our_logits(model_values: dict, hf_model, family: str, ids):
    config = make_config({"mock_data": True, "vocab_size": VOCAB, **model_values}).model
    padded = padded_vocab_size(VOCAB, 128, 1)
    model = GPTModel(config, ParallelState.single(), padded_vocab=padded, seed=7).eval()
    load_into_model(model, weights.to_megatron(family, hf_model.state_dict(), config), TensorSplit())
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]))[..., :VOCAB]


def test_llama_with_gqa_matches_transformers():
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-5, rope_theta=50000.0,
        tie_word_embeddings=False, attention_bias=False)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    ours = our_logits({"model_preset": "llama-tiny", "num_layers": 3, "hidden_size": 96, "ffn_hidden_size": 160,
                       "num_attention_heads": 6, "num_query_groups": 2, "seq_length": SEQ,
                       "max_position_embeddings": SEQ, "rotary_base": 50000.0}, hf_model,
                      "llama", ids)
    with torch.no_grad():
        reference = hf_model(ids).logits
    assert_close_relative(ours, reference, rel=1e-5)


def test_gpt2_matches_transformers():
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    ours = our_logits({"model_preset": "gpt2-124m", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                       "ffn_hidden_size": 256, "seq_length": SEQ, "max_position_embeddings": SEQ}, hf_model,
                      "gpt2", ids)
    with torch.no_grad():
        reference = hf_model(ids).logits
    assert_close_relative(ours, reference, rel=1e-5)


@pytest.mark.parametrize("preset", ["gpt2-124m", "llama-tiny"])
def test_loss_equals_cross_entropy_of_the_logits(preset):
    torch.manual_seed(0)
    config = make_config({"model_preset": preset, "mock_data": True, "vocab_size": VOCAB, "num_layers": 2,
                          "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "seq_length": SEQ,
                          "max_position_embeddings": SEQ, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                          **({"num_query_groups": 2} if preset == "llama-tiny" else {})}).model
    model = GPTModel(config, ParallelState.single(), padded_vocab=padded_vocab_size(VOCAB, 128, 1), seed=3)
    ids, labels = torch.randint(0, VOCAB, (2, SEQ)), torch.randint(0, VOCAB, (2, SEQ))
    positions = torch.arange(SEQ)
    per_token = model(ids, positions, labels=labels)
    logits = model(ids, positions)[..., :VOCAB]
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    assert_close_relative(per_token.reshape(-1), expected, rel=1e-5)
