"""Tokenizers: the ids, special tokens and padded vocab sizes the trainer and tools rely on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.data.tokenizer_training import train_sentencepiece
from megatron_lite.data.tokenizers import build_tokenizer, padded_vocab_size
from megatron_lite.errors import DataError

ENGLISH = ("Now is the winter of our discontent made glorious summer by this sun of York; "
           "and all the clouds that lour'd upon our house in the deep bosom of the ocean buried. ")


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sp")
    with open(folder / "corpus.jsonl", "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"{ENGLISH * (1 + i % 3)}\nLine {i}: {ENGLISH[i % 50:]}"}) + "\n")
    return train_sentencepiece([str(folder / "corpus.jsonl")], str(folder / "tok"), vocab_size=400,
                               json_keys=["text"], special_tokens=["<|im_start|>"],
                               cache_dir=str(folder / "hf"), progress=False)


def test_trained_sentencepiece_has_fixed_special_ids(sentencepiece_model):
    tok = build_tokenizer("SentencePieceTokenizer", sentencepiece_model)
    assert tok.vocab_size == 400
    assert (tok.eod, tok.pad) == (2, 3)
    ids = tok.tokenize("the<|im_start|>winter")
    assert ids.count(4) == 1 and tok.detokenize(ids) == "the<|im_start|>winter"  # kept whole, as id 4


def test_sentencepiece_round_trips_unseen_characters_through_byte_fallback(sentencepiece_model):
    tok = build_tokenizer("SentencePieceTokenizer", sentencepiece_model)
    text = "Naïve  café, 東京 ✓\n\tthe winter of 2024"
    ids = tok.tokenize(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == text


def test_too_small_vocab_for_byte_fallback_is_refused(tmp_path):
    with pytest.raises(ValueError, match="too small for byte fallback"):
        train_sentencepiece(["unused.jsonl"], str(tmp_path / "tok"), vocab_size=100, json_keys=["text"])


def test_a_trained_hugging_face_tokenizer_with_chatml_renders_and_masks_conversations(tmp_path):
    """train_tokenizer.py --tokenizer-type HuggingFaceTokenizer --chat-template chatml: a byte-level tokenizer.json
    folder whose special tokens are single ids, whose eos is the end of a turn and whose chat template --sft reads."""
    from megatron_lite.data.sft.chat_tokenizer import ChatTokenizer

    with open(tmp_path / "corpus.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"{ENGLISH}\nLine {i}: {ENGLISH[i:]}"}) + "\n")
    tool = Path(__file__).resolve().parents[1] / "tools" / "train_tokenizer.py"
    argv = [sys.executable, str(tool), "--input", str(tmp_path / "corpus.jsonl"), "--vocab-size", "300",
            "--model-prefix", str(tmp_path / "chat"), "--tokenizer-type", "HuggingFaceTokenizer", "--cache-dir",
            str(tmp_path / "hf")]
    refused = subprocess.run(argv[:-4] + ["--chat-template", "chatml"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--chat-template writes a Hugging Face tokenizer" in refused.stderr
    subprocess.run(argv + ["--chat-template", "chatml"], check=True, capture_output=True)
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "chat"))
    chat = ChatTokenizer(str(tmp_path / "chat"))
    assert tok.vocab_size == 300 and tok.eod == chat.eod == tok.tokenize("<|im_end|>")[0]
    assert tok.pad == 0 and tok.tokenize("<|endoftext|><|im_start|>") == [0, 1]
    text = "Naïve café, 東京 ✓\n\tthe winter of 2024"
    assert tok.detokenize(tok.tokenize(text)) == text and len(tok.tokenize("2024")) == 4  # a digit a token
    ids, mask = chat.tokenize([{"role": "user", "content": "the winter?"}, {"role": "assistant", "content": "sun"}])
    assert tok.detokenize(ids[mask]) == "sun<|im_end|>"


def _hf_tokenizer_json(path, specials):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([ENGLISH] * 20, trainer)
    tok.save(str(path))
    return tok


def test_huggingface_tokenizer_finds_endoftext_and_round_trips(tmp_path):
    hf = _hf_tokenizer_json(tmp_path / "tokenizer.json", ["<|endoftext|>"])
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    assert tok.eod == hf.token_to_id("<|endoftext|>")
    assert tok.vocab_size == hf.get_vocab_size() and tok.pad is None
    text = "the winter of our café"
    assert tok.tokenize(text) == hf.encode(text).ids
    assert tok.detokenize(tok.tokenize(text)) == text


def test_huggingface_tokenizer_config_names_eos_and_pad(tmp_path):
    hf = _hf_tokenizer_json(tmp_path / "tokenizer.json", ["<|endoftext|>", "<|doc_end|>", "<|pad|>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|doc_end|>"}, "pad_token": "<|pad|>"}))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))  # the folder works as well as the file
    assert tok.eod == hf.token_to_id("<|doc_end|>")
    assert tok.pad == hf.token_to_id("<|pad|>")


def test_huggingface_tokenizer_without_an_end_token_is_refused(tmp_path):
    _hf_tokenizer_json(tmp_path / "tokenizer.json", [])
    with pytest.raises(ValueError, match="end-of-document"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))


def test_null_tokenizer_reads_ids_and_ends_documents_with_the_last_id():
    tok = build_tokenizer("NullTokenizer", None, vocab_size=100)
    assert (tok.vocab_size, tok.eod, tok.pad) == (100, 99, None)
    assert tok.tokenize("5 17 3") == [5, 17, 3]
    assert tok.detokenize([5, 17, 3]) == "5 17 3"


@pytest.mark.parametrize("args, error, message", [
    (("GPT2BPETokenizer", None), ValueError, "unknown --tokenizer-type"),
    (("SentencePieceTokenizer", "/no/such/tokenizer.model"), DataError, "not found"),
    (("SentencePieceTokenizer", None), ValueError, "--tokenizer-model"),
    (("NullTokenizer", None), ValueError, "--vocab-size"),
])
def test_bad_tokenizer_arguments_say_what_to_change(args, error, message):
    with pytest.raises(error, match=message):
        build_tokenizer(*args)


@pytest.mark.parametrize("vocab, divisible_by, tp, padded", [
    (50257, 128, 1, 50304), (50257, 128, 8, 51200), (32000, 128, 2, 32000), (1000, 1, 1, 1000), (5, 4, 3, 12)])
def test_padded_vocab_size_is_the_next_multiple_of_divisible_by_times_tp(vocab, divisible_by, tp, padded):
    assert padded_vocab_size(vocab, divisible_by, tp) == padded


@pytest.mark.parametrize("tokenizer_type, content, message", [
    ("SentencePieceTokenizer", b'{"version": "1.0", "model": {}}',
     r"tok is not a sentencepiece model .*use --tokenizer-type HuggingFaceTokenizer"),
    ("HuggingFaceTokenizer", b"\x0a\x8c\x01\x00 protobuf bytes",
     r"tok is not a Hugging Face tokenizer.json .*if it is a sentencepiece .model, use --tokenizer-type "
     r"SentencePieceTokenizer"),
    ("SentencePieceTokenizer", b"\x00\x01 garbage", r"tok is not a sentencepiece model \([^;]*\)$"),
])
def test_a_tokenizer_file_of_the_wrong_kind_names_the_right_flag(tmp_path, tokenizer_type, content, message):
    (tmp_path / "tok").write_bytes(content)
    with pytest.raises(DataError, match=message) as error:
        build_tokenizer(tokenizer_type, str(tmp_path / "tok"))
    assert "\n" not in str(error.value)
