"""Generation from converted checkpoints: greedy ids equal transformers' generate, KV-cache decoding equals a
full forward pass, TP2 equals one process, sampling keeps to its top-k / top-p sets, and tools/generate.py
reads text with the checkpoint's tokenizer and rejects bad input with one line."""

import pytest
import torch

from megatron_lite.hf.checkpoint import resolve_checkpoint
from megatron_lite.inference.generation import InferenceParams, SamplingParams, generate, load_model, sample
from megatron_lite.parallel.state import Layout, ParallelState
from tests.harness import run_on_ranks
from tests.helpers import HF_FAMILIES, HF_VOCAB, hf_models
from tests.tolerances import assert_close_relative
from tools import generate as generate_tool

PROMPT = torch.randint(0, HF_VOCAB - 1, (2, 6), generator=torch.Generator().manual_seed(5))
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return hf_models(tmp_path_factory)


def transformers_greedy(hf_dir: str, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    model.generation_config.eos_token_id = None  # a random model may emit it; ours is asked not to stop either
    model.generation_config.pad_token_id = 0
    output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                            do_sample=False)
    return output[:, prompt.shape[1]:]


def our_model(mlite_dir: str, pstate=None):
    return load_model(resolve_checkpoint(mlite_dir), pstate)[0]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_greedy_generation_equals_transformers_generate(converted, family):
    hf_dir, mlite_dir = converted[family]
    ours = generate(our_model(mlite_dir), PROMPT, NEW_TOKENS, SamplingParams(greedy=True))
    assert torch.equal(ours, transformers_greedy(hf_dir, PROMPT, NEW_TOKENS))


@pytest.mark.parametrize("family", ["llama", "llama_rope_scaling", "qwen2", "qwen3", "gpt2", "mixtral", "nemotron_h",
                                    "nemotron_h_moe"])
def test_kv_cache_decoding_equals_full_forward(converted, family):
    assert_cached_decoding_equals_full_forward(our_model(converted[family][1]))


def assert_cached_decoding_equals_full_forward(model) -> None:
    """Prompt in one pass, then 3 tokens at once (queries after an offset), then one at a time: the logits of one
    forward over all the tokens."""
    tokens = torch.randint(0, HF_VOCAB, (2, 14), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(tokens, torch.arange(14))[..., :HF_VOCAB]
        params, pieces = InferenceParams(14), []
        for start, end in [(0, 6), (6, 9)] + [(i, i + 1) for i in range(9, 14)]:
            logits = model(tokens[:, start:end], torch.arange(start, end), inference_params=params)
            pieces.append(logits[..., :HF_VOCAB])
            params.sequence_len_offset = end
    assert_close_relative(torch.cat(pieces, dim=1), full, rel=1e-5)


def _generate_at_tp2(dirs: dict, prompt: torch.Tensor) -> dict:
    """Greedy and sampled ids from each checkpoint at TP2 (x DP2: each TP pair generates the same)."""
    pstate = ParallelState.build(Layout(tp=2, dp=2))
    results = {}
    for family, mlite_dir in dirs.items():
        model = our_model(mlite_dir, pstate)
        greedy = generate(model, prompt, NEW_TOKENS, SamplingParams(greedy=True))
        sampled = generate(model, prompt, NEW_TOKENS, SamplingParams(greedy=False, top_k=20, top_p=0.9),
                           generator=torch.Generator().manual_seed(7))
        results[family] = (greedy, sampled)
    return results


def test_tp2_generation_equals_one_process_and_samples_agree_across_tp_ranks(converted):
    dirs = {family: converted[family][1] for family in ("llama", "mixtral")}
    ranks = run_on_ranks(4, _generate_at_tp2, dirs, PROMPT)
    for family, mlite_dir in dirs.items():
        single = generate(our_model(mlite_dir), PROMPT, NEW_TOKENS, SamplingParams(greedy=True))
        for greedy, sampled in (rank[family] for rank in ranks):
            assert torch.equal(greedy, single), family
            assert torch.equal(sampled, ranks[0][family][1]), family


# -------------------------------------------------------------------------------------------------------
# Sampling


def test_sampling_keeps_to_top_k_and_top_p_and_is_reproducible():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.3, 0.15]])).expand(4000, 4)
    draw = lambda params, seed=0: sample(logits, params, torch.Generator().manual_seed(seed))  # noqa: E731
    assert set(draw(SamplingParams(greedy=False, top_k=1)).tolist()) == {1}
    assert set(draw(SamplingParams(greedy=False, top_k=2)).tolist()) == {1, 2}
    assert set(draw(SamplingParams(greedy=False, top_p=0.7)).tolist()) == {1, 2}  # 0.5 < 0.7 <= 0.8
    assert set(draw(SamplingParams(greedy=False, top_p=0.5)).tolist()) == {1}
    everything = draw(SamplingParams(greedy=False))
    assert set(everything.tolist()) == {0, 1, 2, 3}
    assert (everything == 1).float().mean().item() == pytest.approx(0.5, abs=0.03)
    cold = draw(SamplingParams(greedy=False, temperature=0.05))
    assert (cold == 1).float().mean().item() > 0.99
    assert torch.equal(draw(SamplingParams(greedy=False), 3), draw(SamplingParams(greedy=False), 3))
    assert torch.equal(draw(SamplingParams(greedy=True)), torch.ones(4000, dtype=torch.long))


def test_generation_stops_once_every_sequence_has_ended(converted):
    model = our_model(converted["gpt2"][1])
    free = generate(model, PROMPT, NEW_TOKENS, SamplingParams())
    eos = int(free[0, 3])  # a token the first sequence emits
    ends = [int((row == eos).nonzero()[0]) if (row == eos).any() else None for row in free]
    stopped = generate(model, PROMPT, NEW_TOKENS, SamplingParams(), eos_id=eos)
    assert stopped.shape[1] == (max(ends) + 1 if None not in ends else NEW_TOKENS)
    for row, free_row, end in zip(stopped, free, ends):
        if end is None:
            assert torch.equal(row, free_row[:len(row)])
        else:  # the same tokens up to its end, then padded with the end token
            assert torch.equal(row[:end + 1], free_row[:end + 1]) and (row[end:] == eos).all()


# -------------------------------------------------------------------------------------------------------
# tools/generate.py


def run_tool(capsys, *argv: str) -> list[str]:
    generate_tool.main(list(argv))
    return capsys.readouterr().out.strip().splitlines()


def test_generate_tool_prompt_ids_print_transformers_greedy_ids(converted, capsys):
    hf_dir, mlite_dir = converted["gpt2"]
    prompt = " ".join(map(str, PROMPT[0].tolist()))
    lines = run_tool(capsys, "--load", mlite_dir, "--prompt-ids", prompt, "--max-new-tokens", "10", "--greedy",
                     "--output-ids")
    assert lines == [" ".join(map(str, transformers_greedy(hf_dir, PROMPT[:1], 10)[0].tolist()))]


def test_generate_tool_text_prompt_uses_the_checkpoint_tokenizer(converted, capsys):
    mlite_dir = converted["llama"][1]
    lines = run_tool(capsys, "--load", mlite_dir, "--prompt", "w5 w17 w3", "--max-new-tokens", "6", "--ignore-eos",
                     "--output-ids")
    expected = generate(our_model(mlite_dir), torch.tensor([[5, 17, 3]]), 6, SamplingParams())[0].tolist()
    assert lines == [" ".join(["w5", "w17", "w3"] + [f"w{i}" if i < HF_VOCAB - 1 else "</s>" for i in expected]),
                     " ".join(map(str, expected))]


def test_generate_tool_bad_input_is_one_line(converted, capsys):
    mlite_dir = converted["gpt2"][1]
    with pytest.raises(SystemExit) as exit_:
        generate_tool.main(["--load", mlite_dir, "--prompt-ids", "1 2", "--greedy", "--top-k", "3"])
    assert exit_.value.code == 2 and "--greedy cannot be combined" in capsys.readouterr().err
    for argv, expected in ((["--prompt", "hello"], "has no tokenizer"), (["--prompt-ids", f"1 {HF_VOCAB}"], "[0, 300)"),
                           (["--prompt-ids", "1", "--max-new-tokens", "100"], "max-position-embeddings (64)")):
        with pytest.raises(SystemExit) as exit_:
            generate_tool.main(["--load", mlite_dir, *argv])
        error = capsys.readouterr().err.strip()
        assert exit_.value.code == 1 and expected in error and "\n" not in error, error
