"""The user's path end to end: corpus -> tokenizer -> .bin/.idx -> training on 2 ranks equals 1 rank."""

import json
import random

import pytest

from megatron_lite.data.preprocess import preprocess
from megatron_lite.data.tokenizer_training import train_sentencepiece
from tests.harness import run_on_ranks
from tests.helpers import losses_and_norms

TEXT = ("the king of england spoke to his army before the battle and the men answered with one voice "
        "while the queen watched from the castle wall as the sun rose over the hills")
WORDS = TEXT.split()


def write_corpus(path, documents: int = 200) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(documents):
            sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))
            f.write(json.dumps({"text": sentence}) + "\n")


@pytest.mark.slow
def test_preprocessed_corpus_trains_identically_on_one_and_two_ranks(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    model = train_sentencepiece([str(corpus)], str(tmp_path / "tok"), 300, ["text"], progress=False)
    preprocess([str(corpus)], str(tmp_path / "corpus"), ["text"], "SentencePieceTokenizer", tokenizer_model=model,
               append_eod=True, progress=False)
    values = {"model_preset": "llama-tiny", "num_layers": 2, "seq_length": 32, "max_position_embeddings": 32,
              "data_path": [str(tmp_path / "corpus_text_document")], "split": "90,10,0",
              "tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": model, "micro_batch_size": 2,
              "global_batch_size": 8, "train_iters": 8, "lr": 3e-3, "eval_interval": 1000, "log_interval": 1000}
    reference = losses_and_norms(values, 1)
    for rank_result in run_on_ranks(2, losses_and_norms, values, 2):
        for (loss, norm), (ref_loss, ref_norm) in zip(rank_result, reference):
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert norm == pytest.approx(ref_norm, rel=1e-5)
    assert reference[-1][0] < reference[0][0] - 0.5
