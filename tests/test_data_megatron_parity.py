"""The same flags on the same corpus give the same samples, in the same order, as Megatron-Core.

The reference below is Megatron-Core's dataset code (NVIDIA/Megatron-LM, megatron/core/datasets/) written
out in numpy from its definitions, independently of megatron_lite (the `megatron-core` package needs a
C++ compiler at import for its index helpers):

- gpt_dataset.py: GPTDataset._build_document_sample_shuffle_indices (epochs, separate final epoch
  below int(0.8 x samples per epoch)), _get_num_epochs, _build_document_index, _build_shuffle_index;
- helpers.cpp: build_sample_idx (the sample index) and build_blending_indices (the greedy blend);
- blended_megatron_dataset_config.py: parse_and_normalize_split, convert_split_vector_to_split_matrix;
  blended_megatron_dataset_builder.py: _build_megatron_dataset_splits (document ranges of each split),
  _build_blended_dataset_splits and _get_size_per_split_per_dataset (what each blended dataset is asked
  for, with the default mid_level_dataset_surplus 0.005); utils.py: normalize;
- blended_dataset.py: BlendedDataset (weights normalised again, `size` samples).
"""

import functools
import math
import re

import numpy as np
import pytest

from megatron_lite.data.blended_dataset import BlendedDataset, build_blending_indices
from megatron_lite.data.builder import build_per_split_datasets, build_train_valid_test_datasets
from megatron_lite.data.gpt_dataset import build_sample_index
from megatron_lite.data.indexed_dataset import IndexedDatasetBuilder

SEQ = 16
VOCAB = 1 << 30  # token ids are positions in the corpus, all allowed

# -- the reference: Megatron-Core ----------------------------------------------------------------------


def megatron_normalize(weights):
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def megatron_split_matrix(split: str):
    vector = megatron_normalize(list(map(float, re.findall(r"[.0-9]+", split))) + [0.0] * 3)[:3]
    expansion = functools.reduce(lambda a, b: a + [a[len(a) - 1] + b], [[0], *vector])
    bookends = list(zip(expansion[:-1], expansion[1:]))
    return [None if end <= begin else (begin, end) for begin, end in bookends]


def megatron_split_documents(bookend, num_documents):
    begin = int(round(bookend[0] * float(num_documents)))
    end = int(round(bookend[1] * float(num_documents)))
    return np.arange(begin, end, dtype=np.int32)


def megatron_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch):
    """helpers.cpp build_sample_idx with drop_last_partial_sequence and add_extra_token_to_sequence = 1."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int64)
    document_idx_index, doc_offset, sample_idx_index = 0, 0, 1
    while sample_idx_index <= num_samples:
        remaining_seq_length = seq_length + 1
        while remaining_seq_length != 0:
            document_length = int(sizes[document_idx[document_idx_index]]) - doc_offset
            remaining_seq_length -= document_length
            if remaining_seq_length <= 0:
                doc_offset += remaining_seq_length + document_length - 1
                remaining_seq_length = 0
            else:
                if document_idx_index == len(document_idx) - 1:
                    assert sample_idx_index == num_samples
                    doc_offset = int(sizes[document_idx[document_idx_index]]) - 1
                    break
                document_idx_index += 1
                doc_offset = 0
        sample_idx[sample_idx_index] = (document_idx_index, doc_offset)
        sample_idx_index += 1
    return sample_idx


def megatron_document_index(documents, num_epochs, random_state, separate_final_epoch):
    if not separate_final_epoch or num_epochs == 1:
        document_index = np.mgrid[0:num_epochs, 0:len(documents)][1]
        document_index[:] = documents
        document_index = document_index.reshape(-1).astype(np.int32)
        random_state.shuffle(document_index)
        return document_index
    first = megatron_document_index(documents, num_epochs - 1, random_state, False)
    last = megatron_document_index(documents, 1, random_state, False)
    return np.concatenate((first, last))


def megatron_shuffle_index(num_samples, total_size, random_state):
    first = np.arange(0, num_samples, dtype=np.uint32)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.uint32)
    random_state.shuffle(last)
    return np.concatenate((first, last))


def megatron_gpt_indices(sizes, indices, num_samples, seq_length, seed):
    """(document_index, sample_index, shuffle_index); num_samples None builds one epoch."""
    tokens_per_epoch = int(np.sum(sizes[indices]))
    num_epochs, num_tokens = 1, tokens_per_epoch
    if num_samples is not None:
        while num_tokens < num_samples * seq_length + 1:
            num_epochs += 1
            num_tokens += tokens_per_epoch
    separate_final_epoch = False
    if num_epochs > 1:
        num_samples_sans_final_epoch = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        num_samples_from_final_epoch = num_samples - num_samples_sans_final_epoch
        num_samples_per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = num_samples_from_final_epoch < int(0.80 * num_samples_per_epoch)
    random_state = np.random.RandomState(seed)
    document_index = megatron_document_index(indices, num_epochs, random_state, separate_final_epoch)
    sample_index = megatron_sample_idx(sizes, document_index, seq_length, num_epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    first = num_samples_sans_final_epoch if separate_final_epoch else total
    return document_index, sample_index, megatron_shuffle_index(first, total, random_state)


def megatron_blending_indices(weights, size):
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    current_samples = [0] * len(weights)
    for sample_idx in range(size):
        sample_idx_double = max(float(sample_idx), 1.0)
        max_error_index = 0
        max_error = weights[0] * sample_idx_double - float(current_samples[0])
        for dataset_idx in range(1, len(weights)):
            error = weights[dataset_idx] * sample_idx_double - float(current_samples[dataset_idx])
            if error > max_error:
                max_error, max_error_index = error, dataset_idx
        dataset_index[sample_idx] = max_error_index
        dataset_sample_index[sample_idx] = current_samples[max_error_index]
        current_samples[max_error_index] += 1
    return dataset_index, dataset_sample_index


def megatron_size_per_dataset(normalized_weights, target_size, surplus=0.0):
    return [int(math.ceil(math.ceil(target_size * w) * (1 + surplus))) for w in normalized_weights]


def megatron_blend(sizes_per_prefix, indices_per_prefix, weights, target_size, seed):
    """_build_blended_dataset_splits for one split of a blend of several prefixes (or one with a weight):
    the components' indices and the blend's (dataset_index, dataset_sample_index)."""
    if weights is not None:
        weights = megatron_normalize(weights)
        targets = megatron_size_per_dataset(weights, target_size)
        buffers = megatron_size_per_dataset(weights, target_size, surplus=0.005)
        components = [megatron_gpt_indices(s, i, n, SEQ, seed)
                      for s, i, n in zip(sizes_per_prefix, indices_per_prefix, buffers)]
        size = sum(targets)
    else:
        components = [megatron_gpt_indices(s, i, None, SEQ, seed) for s, i in zip(sizes_per_prefix, indices_per_prefix)]
        weights = [c[1].shape[0] - 1 for c in components]  # len() of each one-epoch GPTDataset
        size = min(target_size, sum(weights))
    return components, megatron_blending_indices(megatron_normalize(weights), size)  # BlendedDataset normalises


# -- corpora and comparisons ---------------------------------------------------------------------------


def write_corpus(path, lengths, first_token=0):
    """Documents of `lengths` whose token ids are their positions (from first_token): each token is unique."""
    builder = IndexedDatasetBuilder(str(path), np.int32)
    for start, n in zip(first_token + np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths):
        builder.add_document(np.arange(start, start + n))
    builder.finalize()
    return str(path)


def corpus_lengths(num_documents, seed):
    return np.random.default_rng(seed).integers(1, 120, size=num_documents).astype(np.int32)


def megatron_sample(sizes, document_index, sample_index, shuffle_index, i, first_token=0):
    """_query_document_sample_shuffle_indices: sample i's seq_length + 1 tokens (ids = corpus positions)."""
    starts = first_token + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    j = int(shuffle_index[i])
    (begin, begin_offset), (end, end_offset) = sample_index[j], sample_index[j + 1]
    parts = []
    for k in range(begin, end + 1):
        doc = int(document_index[k])
        offset = begin_offset if k == begin else 0
        stop = end_offset + 1 if k == end else sizes[doc]
        parts.append(np.arange(starts[doc] + offset, starts[doc] + stop))
    return np.concatenate(parts)


def assert_same_gpt_dataset(ours, reference):
    document_index, sample_index, shuffle_index = reference
    np.testing.assert_array_equal(ours.document_index, document_index)
    np.testing.assert_array_equal(ours.sample_index, sample_index)
    np.testing.assert_array_equal(ours.shuffle_index, shuffle_index)


def epoch_samples(sizes, indices):
    return (int(np.sum(sizes[indices])) - 1) // SEQ


def split_sizes(lengths, split, epochs):
    """(indices per split, samples asked per split): `epochs` epochs of each split that has documents."""
    matrix = megatron_split_matrix(split)
    indices = [None if b is None else megatron_split_documents(b, len(lengths)) for b in matrix]
    asked = [0 if i is None or len(i) == 0 or np.sum(lengths[i]) <= SEQ
             else max(1, int(epochs * epoch_samples(lengths, i))) for i in indices]
    return indices, asked


# -- the tests -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_documents", [294, 300, 1000])
@pytest.mark.parametrize("split", ["969,30,1", "90,7,3", "98,2,0"])
@pytest.mark.parametrize("epochs", [0.4, 1.5, 1.9, 2.5, 3])
def test_one_prefix_gives_megatrons_indices_for_every_split_and_epoch_count(tmp_path, num_documents, split, epochs):
    lengths = corpus_lengths(num_documents, seed=num_documents)
    prefix = write_corpus(tmp_path / "corpus", lengths)
    indices, asked = split_sizes(lengths, split, epochs)
    seed = 1234 + num_documents
    ours = build_train_valid_test_datasets([prefix], split, SEQ, seed, tuple(asked), vocab_size=VOCAB)
    for dataset, split_indices, n in zip(ours, indices, asked):
        if n == 0:
            assert dataset is None
            continue
        reference = megatron_gpt_indices(lengths, split_indices, n, SEQ, seed)
        assert_same_gpt_dataset(dataset, reference)
        for i in (0, len(dataset) // 2, len(dataset) - 1):
            np.testing.assert_array_equal(dataset[i], megatron_sample(lengths, *reference, i))


def test_the_separate_final_epoch_threshold_is_rounded_down_as_in_megatron(tmp_path):
    indices = np.arange(300, dtype=np.int32)
    # a corpus whose 0.8 x samples per epoch is not a whole number: the case where the rounding decides
    lengths = next(lens for lens in (corpus_lengths(300, seed=s) for s in range(300, 400))
                   if 0.8 * epoch_samples(lens, indices) != int(0.8 * epoch_samples(lens, indices)))
    prefix = write_corpus(tmp_path / "corpus", lengths)
    per_epoch = epoch_samples(lengths, indices)
    before_final = (int(np.sum(lengths)) - 1) // SEQ  # the samples of the first of two epochs
    for n in (before_final + int(0.8 * per_epoch) - 1, before_final + int(0.8 * per_epoch)):
        train, _, _ = build_train_valid_test_datasets([prefix], "1", SEQ, 7, (n, 0, 0), vocab_size=VOCAB)
        assert_same_gpt_dataset(train, megatron_gpt_indices(lengths, indices, n, SEQ, 7))


def test_sample_index_equals_megatrons_with_empty_documents():
    lengths = np.array([0, 0, 5, 0, 17, 1, 0, 33, 2, 16, 0, 9], dtype=np.int32)
    for seq_length in (2, 3, 16):
        document_idx = np.arange(len(lengths), dtype=np.int32)
        reference = megatron_sample_idx(lengths, document_idx, seq_length, 1, int(lengths.sum()))
        np.testing.assert_array_equal(build_sample_index(lengths, seq_length), reference)


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [3, 1, 2, 2], np.random.default_rng(0).random(40).tolist(),
                                     [1.0] * 20 + [2.0] * 20])
def test_blending_indices_are_megatrons_greedy_choice_ties_included(weights):
    """Few datasets and many (a per-sample numpy argmax), equal weights giving exact ties."""
    ours = build_blending_indices(weights, 2000)
    reference = megatron_blending_indices(megatron_normalize(weights), 2000)
    for got, want in zip(ours, reference):
        np.testing.assert_array_equal(got, want)


def blend_corpora(tmp_path, counts=(180, 240, 300)):
    """Three corpora of different sizes, with token ids in disjoint ranges."""
    lengths = [corpus_lengths(n, seed=n) for n in counts]
    prefixes = [write_corpus(tmp_path / f"c{k}", lens, first_token=k << 20) for k, lens in enumerate(lengths)]
    return lengths, prefixes


def assert_same_blend(ours, reference, lengths, size=None):
    components, (dataset_index, dataset_sample_index) = reference
    assert isinstance(ours, BlendedDataset)
    if size is None:
        assert len(ours) == len(dataset_index)
        size = len(dataset_index)
    np.testing.assert_array_equal(ours.dataset_index[:size], dataset_index[:size])
    np.testing.assert_array_equal(ours.dataset_sample_index[:size], dataset_sample_index[:size])
    for dataset, component in zip(ours.datasets, components):
        assert_same_gpt_dataset(dataset, component)
    for i in (0, 1, size // 2, size - 1):
        d = int(dataset_index[i])
        expected = megatron_sample(lengths[d], *components[d], int(dataset_sample_index[i]), first_token=d << 20)
        np.testing.assert_array_equal(ours[i], expected)


@pytest.mark.parametrize("split", ["969,30,1", "90,7,3", "98,2,0"])
@pytest.mark.parametrize("epochs", [0.4, 1.5, 2.5])
def test_a_weighted_three_way_blend_gives_megatrons_indices(tmp_path, split, epochs):
    lengths, prefixes = blend_corpora(tmp_path)
    weights = [0.5, 0.3, 0.2]
    data_path = [str(x) for pair in zip(weights, prefixes) for x in pair]
    per_prefix = [split_sizes(lens, split, epochs)[0] for lens in lengths]
    # samples asked of the blend: `epochs` epochs of the first corpus's split, where every corpus has documents
    asked = [0 if any(p[i] is None or len(p[i]) == 0 for p in per_prefix)
             else max(1, int(epochs * epoch_samples(lengths[0], per_prefix[0][i]))) for i in range(3)]
    ours = build_train_valid_test_datasets(data_path, split, SEQ, 5, tuple(asked), vocab_size=VOCAB)
    for i, (dataset, n) in enumerate(zip(ours, asked)):
        if n == 0:
            assert dataset is None
            continue
        reference = megatron_blend(lengths, [p[i] for p in per_prefix], weights, n, 5)
        assert_same_blend(dataset, reference, lengths)


def test_an_unweighted_three_way_blend_weighs_each_prefix_by_its_samples_per_epoch(tmp_path):
    lengths, prefixes = blend_corpora(tmp_path)
    per_prefix = [split_sizes(lens, "90,7,3", 1)[0] for lens in lengths]
    one_epoch = [sum(epoch_samples(lens, p[0]) for lens, p in zip(lengths, per_prefix)),
                 sum(epoch_samples(lens, p[1]) for lens, p in zip(lengths, per_prefix))]
    asked = (one_epoch[0] - 3, one_epoch[1] // 2, 0)  # Megatron builds at most one epoch of the blend
    ours = build_train_valid_test_datasets(prefixes, "90,7,3", SEQ, 11, asked, vocab_size=VOCAB)
    for i in range(2):
        reference = megatron_blend(lengths, [p[i] for p in per_prefix], None, asked[i], 11)
        assert len(ours[i]) == asked[i]
        assert_same_blend(ours[i], reference, lengths)


def test_an_unweighted_blend_beyond_one_epoch_continues_megatrons_order(tmp_path):
    lengths, prefixes = blend_corpora(tmp_path)
    whole = [np.arange(len(lens), dtype=np.int32) for lens in lengths]
    total = sum(epoch_samples(lens, i) for lens, i in zip(lengths, whole))
    train, _, _ = build_train_valid_test_datasets(prefixes, "1", SEQ, 3, (2 * total, 0, 0), vocab_size=VOCAB)
    assert len(train) == 2 * total
    _, (dataset_index, dataset_sample_index) = megatron_blend(lengths, whole, None, 2 * total, 3)
    np.testing.assert_array_equal(train.dataset_index[:total], dataset_index)  # Megatron stops at one epoch
    np.testing.assert_array_equal(train.dataset_sample_index[:total], dataset_sample_index)


def test_per_split_blends_give_megatrons_indices(tmp_path):
    lengths, prefixes = blend_corpora(tmp_path)
    weights = [0.2, 0.5, 0.3]
    train_path = [str(x) for pair in zip(weights, prefixes) for x in pair]
    whole = [np.arange(len(lens), dtype=np.int32) for lens in lengths]
    n_train, n_valid = int(1.9 * epoch_samples(lengths[1], whole[1])), 40
    train, valid, test = build_per_split_datasets((train_path, ["1.0", prefixes[2]], []), SEQ, 9,
                                                  (n_train, n_valid, 0), vocab_size=VOCAB)
    assert test is None
    assert_same_blend(train, megatron_blend(lengths, whole, weights, n_train, 9), lengths)
    # Megatron reads a per-split blend of one prefix as that prefix alone, its weight ignored
    assert_same_gpt_dataset(valid, megatron_gpt_indices(lengths[2], whole[2], n_valid, SEQ, 9))


def test_one_weighted_prefix_is_a_blend_of_one_as_in_megatron(tmp_path):
    lengths, prefixes = blend_corpora(tmp_path, counts=(250,))
    indices, asked = split_sizes(lengths[0], "98,2,0", 1.5)
    ours = build_train_valid_test_datasets(["1.0", prefixes[0]], "98,2,0", SEQ, 2, tuple(asked), vocab_size=VOCAB)
    for i in range(2):
        assert_same_blend(ours[i], megatron_blend(lengths, [indices[i]], [1.0], asked[i], 2), lengths)
