#!/usr/bin/env bash
# The main job, end to end on a fresh machine (CPU or GPU): install, fetch the Shakespeare demo corpus,
# train a tokenizer, preprocess, pretrain llama-tiny with data parallelism on 2 processes (checkpoints in
# checkpoints/demo, downstream accuracy on the shipped Shakespeare tasks at each evaluation), plot its curves,
# score the model with lm-evaluation-harness, and let it write from a Shakespeare prompt.
# Run again, it resumes from the last checkpoint, or goes straight to writing when training is done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
SAVE=checkpoints/demo
TASKS=megatron_lite/evaluation/tasks
TRAIN_ITERS=${TRAIN_ITERS:-200}
export OMP_NUM_THREADS=1
[ -f data/shakespeare.jsonl ] || "$PY" tools/download_demo_corpus.py
[ -f data/tokenizer.model ] || "$PY" tools/train_tokenizer.py --input data/shakespeare.jsonl \
    --vocab-size 4000 --model-prefix data/tokenizer
[ -f data/shakespeare_text_document.idx ] || "$PY" tools/preprocess_data.py --input data/shakespeare.jsonl \
    --json-keys text --output-prefix data/shakespeare --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model data/tokenizer.model --append-eod --workers 2
trained=$(cat "$SAVE/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
if [ "$trained" -ge "$TRAIN_ITERS" ]; then
    echo "$SAVE already holds iteration $trained of $TRAIN_ITERS: not training again (rm -rf $SAVE to start over)"
else
    [ "$trained" -eq 0 ] || echo "resuming $SAVE from iteration $trained of $TRAIN_ITERS"
    "$VENV/bin/torchrun" --nproc-per-node "${NPROC:-2}" pretrain_gpt.py --model-preset llama-tiny \
        --data-path data/shakespeare_text_document --split 969,30,1 \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/tokenizer.model \
        --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
        --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.1 \
        --log-interval 10 --eval-interval 100 --eval-iters 5 \
        --eval-tasks "$TASKS/shakespeare_cloze.yaml" "$TASKS/shakespeare_next_word.yaml" --eval-task-limit 50 \
        --save "$SAVE" --load "$SAVE" --save-interval 50 --metrics-jsonl "$SAVE/metrics.jsonl" "$@"
fi
"$PY" tools/plot_metrics.py "$SAVE/metrics.jsonl" --labels demo --output "$SAVE/curves.png"
printf '\nlm-evaluation-harness on the trained model (shipped tasks, 200 documents each):\n\n'
HF_DATASETS_OFFLINE=1 "$PY" tools/run_lm_eval.py --model megatron_lite --model_args "load=$SAVE" \
    --include_path "$TASKS" --tasks shakespeare_cloze shakespeare_next_word --batch_size 8 --device cpu \
    --verbosity ERROR
PROMPT="ROMEO. O, she doth teach the torches to burn bright!"
printf '\nWhat the model writes after "%s" (sampled: top-k 40, temperature 0.8):\n\n' "$PROMPT"
"$PY" tools/generate.py --load "$SAVE" --prompt "$PROMPT" --max-new-tokens 96 --top-k 40 --temperature 0.8
