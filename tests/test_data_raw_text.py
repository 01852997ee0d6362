"""Raw-text training data: the samples are the documents, in the documented seeded order, tokenized and packed
as written out here; a resume reads exactly the samples that follow, at any data-parallel size."""

import gzip
import json
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_lite.config.arguments import make_config
from megatron_lite.errors import DataError
from megatron_lite.training.loop import build_data_iterator, build_datasets
from tests.corpora import make_prefix

VOCAB, SEQ, SEED, CHUNK_BYTES = 500, 16, 1234, 512
EOD = VOCAB - 1  # NullTokenizer's end-of-document id


def write_documents(path, documents, key="text", opener=open):
    with opener(path, "wt") as f:
        for document in documents:
            f.write(json.dumps({key: " ".join(map(str, document)), "id": len(document)}) + "\n")


def random_documents(count, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB - 1, size=rng.integers(1, 40)).tolist() for _ in range(count)]


def values(data_path, **extra):
    return {"data_path": data_path, "tokenizer_type": "NullTokenizer", "vocab_size": VOCAB, "seq_length": SEQ,
            "max_position_embeddings": SEQ, "micro_batch_size": 2, "global_batch_size": 8, "train_iters": 12,
            "split": "100,0,0", "raw_text_chunk_mib": CHUNK_BYTES / 2**20, "seed": SEED, "eval_interval": 1000,
            **extra}


def expected_stream(path, documents, epochs, source=0):
    """The token stream by the documented rule: chunks of CHUNK_BYTES bytes (a line in the chunk its first byte
    is in) in RandomState([seed, source, epoch]) order, their documents in RandomState([seed, source, epoch,
    chunk, 1]) order, each followed by the end-of-document id."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")[:-1]
    starts = np.cumsum([0] + [len(line) + 1 for line in lines[:-1]])
    size = starts[-1] + len(lines[-1]) + 1
    chunks = [[documents[i] for i, s in enumerate(starts) if begin <= s < begin + CHUNK_BYTES]
              for begin in range(0, size, CHUNK_BYTES)]
    stream = []
    for epoch in range(epochs):
        for c in np.random.RandomState([SEED, source, epoch]).permutation(len(chunks)):
            docs = chunks[c]
            for d in np.random.RandomState([SEED, source, epoch, c, 1]).permutation(len(docs)):
                stream += docs[d] + [EOD]
    return np.array(stream)


def samples_of(stream, count):
    return [stream[j * SEQ: j * SEQ + SEQ + 1] for j in range(count)]


def read_samples(config, consumed=0, dp=1):
    """Per data-parallel rank, the token rows of every micro-batch from `consumed` on."""
    dataset = build_datasets(config)[0]
    ranks = []
    for rank in range(dp):
        pstate = SimpleNamespace(dp_rank=rank, dp_size=dp)  # all build_data_iterator asks of the parallel state
        ranks.append([np.concatenate([batch["tokens"].numpy(), batch["labels"].numpy()[:, -1:]], axis=1)
                      for batch in build_data_iterator(dataset, config, pstate, consumed)])
    return dataset, ranks


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("raw")
    documents = random_documents(60, 0)
    write_documents(folder / "a.jsonl", documents)
    return folder, documents


def test_samples_are_the_shuffled_documents_tokenized_and_packed(corpus):
    folder, documents = corpus
    config = make_config(values([str(folder / "a.jsonl")]))
    stream = expected_stream(folder / "a.jsonl", documents, epochs=4)  # 12 x 8 samples of 16 take 2+ epochs
    _, (batches,) = read_samples(config)
    got = np.concatenate(batches)
    assert len(got) == 96
    np.testing.assert_array_equal(got, np.stack(samples_of(stream, 96)))


def test_gzip_zstd_parquet_and_saved_datasets_give_the_same_documents(corpus, tmp_path):
    """One chunk each (a compressed file is read whole, the Parquet file is one row group, 60 rows < 1024)."""
    import datasets
    import zstandard

    _, documents = corpus
    write_documents(tmp_path / "a.jsonl.gz", documents, opener=gzip.open)
    write_documents(tmp_path / "a.jsonl.zst", documents, opener=zstandard.open)
    texts = {"text": [" ".join(map(str, d)) for d in documents]}
    datasets.Dataset.from_dict(texts).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_dict(texts).save_to_disk(str(tmp_path / "saved"))
    order = np.random.RandomState([SEED, 0, 0, 0, 1]).permutation(60)
    stream = np.array([t for d in order for t in documents[d] + [EOD]])
    for path in ("a.jsonl.gz", "a.jsonl.zst", "a.parquet", "saved"):
        _, (batches,) = read_samples(make_config(values([str(tmp_path / path)], train_iters=2)))
        np.testing.assert_array_equal(np.concatenate(batches), np.stack(samples_of(stream, 16)), err_msg=path)


def megatron_greedy(weights, size):
    """Megatron-Core's build_blending_indices: each sample goes to the source furthest below its share."""
    weights = np.asarray(weights) / np.sum(weights)
    counts, chosen = np.zeros(len(weights)), []
    for i in range(size):
        best = int(np.argmax(weights * max(i, 1) - counts))
        chosen.append(best)
        counts[best] += 1
    return chosen


def test_a_raw_blend_takes_each_sample_from_the_source_megatrons_rule_names(corpus, tmp_path):
    folder, documents = corpus
    other = random_documents(50, 1)
    write_documents(tmp_path / "b.jsonl", other)
    config = make_config(values(["0.3", str(folder / "a.jsonl"), "0.7", str(tmp_path / "b.jsonl")]))
    streams = [iter(samples_of(expected_stream(folder / "a.jsonl", documents, 4, source=0), 96)),
               iter(samples_of(expected_stream(tmp_path / "b.jsonl", other, 4, source=1), 96))]
    expected = [next(streams[s]) for s in megatron_greedy([0.3, 0.7], 96)]
    _, (batches,) = read_samples(config)
    np.testing.assert_array_equal(np.concatenate(batches), np.stack(expected))


def test_a_blend_of_raw_text_and_an_indexed_prefix_is_refused(corpus, tmp_path):
    folder, _ = corpus
    prefix = make_prefix(tmp_path, "indexed", 0, 20)
    config = make_config(values(["0.5", str(folder / "a.jsonl"), "0.5", prefix]))
    with pytest.raises(DataError, match="mixes raw text .* with the indexed prefix"):
        build_datasets(config)


@pytest.mark.parametrize("dp_before, dp_after", [(2, 4), (2, 1), (4, 2)])
def test_a_resume_from_the_saved_position_reads_the_next_samples_at_another_dp_size(corpus, dp_before, dp_after):
    """The position rank 0 records after iteration 5 (what a checkpoint saves), restored at another size,
    gives the samples the uninterrupted run reads from sample 40 on."""
    folder, _ = corpus
    config = make_config(values([str(folder / "a.jsonl")]))
    _, (single,) = read_samples(config)
    uninterrupted = np.concatenate(single)
    dataset = build_datasets(config)[0]
    pstate = SimpleNamespace(dp_rank=0, dp_size=dp_before)
    iterator = build_data_iterator(dataset, config, pstate, 0)
    for _ in range(5 * 8 // (2 * dp_before)):
        next(iterator)
    state = dataset.loader_state(40)
    assert state is not None

    resumed_config = make_config(values([str(folder / "a.jsonl")]))
    resumed_dataset = build_datasets(resumed_config)[0]
    resumed_dataset.restore_loader_state(json.loads(json.dumps(state)), 40)  # as metadata.json holds it
    ranks = []
    for rank in range(dp_after):
        pstate = SimpleNamespace(dp_rank=rank, dp_size=dp_after)
        ranks.append(list(build_data_iterator(resumed_dataset, resumed_config, pstate, 40)))
    rows = [np.concatenate([b["tokens"].numpy(), b["labels"].numpy()[:, -1:]], axis=1)
            for step in zip(*ranks) for b in step]
    np.testing.assert_array_equal(np.concatenate(rows), uninterrupted[40:])


def test_a_stream_without_a_saved_position_reads_up_to_the_consumed_samples(corpus):
    folder, _ = corpus
    config = make_config(values([str(folder / "a.jsonl")]))
    _, (single,) = read_samples(config)
    _, (resumed,) = read_samples(make_config(values([str(folder / "a.jsonl")])), consumed=24)
    np.testing.assert_array_equal(np.concatenate(resumed), np.concatenate(single)[24:])


def test_a_damaged_saved_position_is_refused_with_one_line(corpus):
    folder, _ = corpus
    path = str(folder / "a.jsonl")
    dataset = build_datasets(make_config(values([path])))[0]
    good = {"epoch": 0, "chunk": 1, "document": 2, "offset": 3, "bad_records": 0}
    for state in (["not", "an", "object"],
                  {"consumed_samples": 40, "sources": [path], "positions": [{**good, "offset": "3"}]},
                  {"consumed_samples": 40, "sources": [path], "positions": [{**good, "offset": -1}]},
                  {"consumed_samples": 40, "sources": [path], "positions": [{"epoch": 0}]},
                  {"consumed_samples": 40, "sources": [path], "positions": [good, good]},
                  {"consumed_samples": 40, "sources": [path], "positions": 7},
                  {"consumed_samples": 40, "sources": [path]}):
        with pytest.raises(DataError, match=r"^the checkpoint's data_loader .*remove 'data_loader' from its "
                                            r"metadata.json to re-read the stream$"):
            dataset.restore_loader_state(state, 40)
