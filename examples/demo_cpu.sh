#!/usr/bin/env bash
# The main job, end to end on a fresh machine (CPU or GPU): install, fetch the Shakespeare demo corpus,
# train a tokenizer, preprocess, then pretrain llama-tiny with data parallelism on 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
export OMP_NUM_THREADS=1
[ -f data/shakespeare.jsonl ] || "$PY" tools/download_demo_corpus.py
[ -f data/tokenizer.model ] || "$PY" tools/train_tokenizer.py --input data/shakespeare.jsonl \
    --vocab-size 4000 --model-prefix data/tokenizer
[ -f data/shakespeare_text_document.idx ] || "$PY" tools/preprocess_data.py --input data/shakespeare.jsonl \
    --json-keys text --output-prefix data/shakespeare --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model data/tokenizer.model --append-eod --workers 2
"$VENV/bin/torchrun" --nproc-per-node "${NPROC:-2}" pretrain_gpt.py --model-preset llama-tiny \
    --data-path data/shakespeare_text_document --split 969,30,1 \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tokenizer.model \
    --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters "${TRAIN_ITERS:-200}" \
    --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.1 \
    --log-interval 10 --eval-interval 100 --eval-iters 5 --metrics-jsonl checkpoints/demo/metrics.jsonl "$@"
