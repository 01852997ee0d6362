#!/usr/bin/env bash
# Supervised fine-tuning end to end on a fresh machine (CPU or GPU), 2-3 minutes on 2 CPU cores: install, fetch
# the Shakespeare demo corpus, train a Hugging Face tokenizer with a ChatML chat template, pretrain llama-tiny on
# Shakespeare for a minute (checkpoints/sft_demo_base), fine-tune it with --sft on the shipped chat set
# examples/sft/tiny_chat.jsonl, tokenized once with its assistant masks by tools/preprocess_data.py --sft
# (checkpoints/sft_demo), export it to Hugging Face with its chat template (checkpoints/sft_demo_hf), and ask it
# questions with tools/generate.py --chat. Run again, each step resumes or is skipped when it is done.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
BASE=checkpoints/sft_demo_base
SFT=checkpoints/sft_demo
HF=checkpoints/sft_demo_hf
TOKENIZER=data/chat_tokenizer
PRETRAIN_ITERS=${PRETRAIN_ITERS:-100}
SFT_ITERS=${SFT_ITERS:-400}
export OMP_NUM_THREADS=1
iteration() { cat "$1/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0; }
[ -f data/shakespeare.jsonl ] || "$PY" tools/download_demo_corpus.py
[ -f "$TOKENIZER/tokenizer.json" ] || "$PY" tools/train_tokenizer.py --input data/shakespeare.jsonl \
    --vocab-size 1024 --tokenizer-type HuggingFaceTokenizer --chat-template chatml --model-prefix "$TOKENIZER"
[ -f data/shakespeare_chatml_text_document.idx ] || "$PY" tools/preprocess_data.py \
    --input data/shakespeare.jsonl --json-keys text --output-prefix data/shakespeare_chatml \
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" --append-eod --workers 2
[ -f data/tiny_chat_sft.idx ] || "$PY" tools/preprocess_data.py --sft --input examples/sft/tiny_chat.jsonl \
    --output-prefix data/tiny_chat --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
TRAIN=(--model-preset llama-tiny --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
       --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --lr-decay-style cosine --weight-decay 0.1
       --log-interval 10 --eval-interval 1000 --eval-iters 1)

trained=$(iteration "$BASE")
if [ "$trained" -ge "$PRETRAIN_ITERS" ]; then
    echo "$BASE already holds iteration $trained of $PRETRAIN_ITERS: not pretraining again (rm -rf $BASE to start over)"
else
    "$VENV/bin/torchrun" --nproc-per-node "${NPROC:-2}" pretrain_gpt.py "${TRAIN[@]}" \
        --data-path data/shakespeare_chatml_text_document --split 99,1,0 --train-iters "$PRETRAIN_ITERS" \
        --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --save "$BASE" --load "$BASE" --save-interval 50
fi

trained=$(iteration "$SFT")
if [ "$trained" -ge "$SFT_ITERS" ]; then
    echo "$SFT already holds iteration $trained of $SFT_ITERS: not fine-tuning again (rm -rf $SFT $HF to start over)"
else
    if [ "$trained" -eq 0 ]; then FROM=(--load "$BASE" --finetune); else FROM=(--load "$SFT"); fi
    "$VENV/bin/torchrun" --nproc-per-node "${NPROC:-2}" pretrain_gpt.py "${TRAIN[@]}" --sft \
        --data-path data/tiny_chat_sft --split 100,0,0 --train-iters "$SFT_ITERS" \
        --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --save "$SFT" --save-interval 100 "${FROM[@]}" "$@"
fi
[ -f "$HF/config.json" ] || "$PY" tools/convert_checkpoint.py --direction mlite-to-hf --load-dir "$SFT" \
    --save-dir "$HF"

printf '\nThe fine-tuned model answers (greedy, up to its end of turn):\n\n'
for question in "What is the capital of Japan?" "What day comes after Friday?" "What colour is snow?"; do
    printf 'user: %s\nassistant: ' "$question"
    "$PY" tools/generate.py --load "$SFT" --chat --prompt "$question" --max-new-tokens 32
done
TOOLS="To use a tool, write: call: name(argument)."
printf 'system: %s\nuser: What is the weather in Oslo?\nassistant: ' "$TOOLS"
"$PY" tools/generate.py --load "$SFT" --chat --system "$TOOLS" --prompt "What is the weather in Oslo?" \
    --max-new-tokens 32
