"""The data pipeline: raw text -> tokens in Megatron's .bin/.idx files -> training samples.

    tokenizers.py          SentencePiece / HuggingFace / Null tokenizers, padded vocab size
    tokenizer_training.py  trains a sentencepiece BPE model (tools/train_tokenizer.py)
    corpus.py              reads jsonl/json/parquet/arrow/txt inputs through HF datasets
    preprocess.py          tokenizes a corpus in worker processes (tools/preprocess_data.py)
    indexed_dataset.py     IndexedDataset / IndexedDatasetBuilder: the mmap .bin/.idx format
    index_cache.py         index arrays cached on disk, built once under a file lock
    gpt_dataset.py         GPTDataset: shuffled seq_length + 1 token samples across documents
    blended_dataset.py     BlendedDataset: several datasets mixed by weight
    builder.py             train/valid/test datasets from --data-path and --split, or a corpus per split
    samplers.py            which samples each data-parallel rank reads, from consumed samples
    mock.py                synthetic samples for --mock-data
"""
