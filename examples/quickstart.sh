#!/usr/bin/env bash
# Quickstart: end-to-end GPT pre-training on CPU, no internet needed.
#
#   bash examples/quickstart.sh                       # baseline
#   bash examples/quickstart.sh --quantized-weights --quantized-gradients --hadamard-transform
#
# Steps (each is skipped when its output already exists, so the script can be rerun):
#   1. corpus     : Python standard-library sources -> data/quickstart/corpus.jsonl (~4 MB)
#   2. tokenizer  : byte-level BPE (vocab 8192)     -> data/quickstart/tokenizer/{vocab.json,merges.txt}
#   3. preprocess : megatron-core .bin/.idx          -> data/quickstart/stdlib_text_document.{bin,idx}
#   4. train      : torchrun, 2 CPU processes (gloo), tiny GPT -> runs/quickstart/<run name>/
#
# Extra arguments are passed through to pretrain_gpt.py.  Environment overrides:
#   DATA_DIR (data/quickstart)  RUN_DIR (runs/quickstart/<name>)  RUN_NAME (baseline, or derived
#   from the extra args)  NPROC (2)  TRAIN_ITERS (100)  CORPUS_BYTES (4000000)  VOCAB_SIZE (8192)
#   PYTHON (python)  TORCHRUN ("$PYTHON -m torch.distributed.run")
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# On a fresh machine, install what is missing first (torch==2.13.0, then requirements.txt).
PYTHON="${PYTHON:-python3}" bash scripts/ensure_deps.sh

PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-"$PYTHON -m torch.distributed.run"}
DATA_DIR=${DATA_DIR:-data/quickstart}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-100}
CORPUS_BYTES=${CORPUS_BYTES:-4000000}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
PREPROCESS_WORKERS=${PREPROCESS_WORKERS:-2}

# One run directory per flag combination, so that reruns resume the right checkpoint.
if [[ -z "${RUN_NAME:-}" ]]; then
    if [[ $# -eq 0 ]]; then
        RUN_NAME=baseline
    else
        RUN_NAME=$(printf '%s_' "$@" | sed -e 's/^--//' -e 's/_--/_/g' -e 's/[^A-Za-z0-9._=-]/-/g' -e 's/_$//' | cut -c1-120)
    fi
fi
RUN_DIR=${RUN_DIR:-runs/quickstart/$RUN_NAME}

CORPUS="$DATA_DIR/corpus.jsonl"
TOK_DIR="$DATA_DIR/tokenizer"
VOCAB_FILE="$TOK_DIR/vocab.json"
MERGE_FILE="$TOK_DIR/merges.txt"
DATA_PREFIX="$DATA_DIR/stdlib"
DATA_PATH="${DATA_PREFIX}_text_document"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

log() { echo "[quickstart] $*" >&2; }

mkdir -p "$DATA_DIR" "$RUN_DIR"

# 1. corpus ------------------------------------------------------------------------------------
if [[ -s "$CORPUS" ]]; then
    log "corpus exists: $CORPUS (skipping)"
else
    log "building corpus from the Python standard library -> $CORPUS"
    $PYTHON tools/make_quickstart_corpus.py --output "$CORPUS" --max-bytes "$CORPUS_BYTES"
fi

# 2. tokenizer ---------------------------------------------------------------------------------
if [[ -s "$VOCAB_FILE" && -s "$MERGE_FILE" ]]; then
    log "tokenizer exists: $TOK_DIR (skipping)"
else
    log "training byte-level BPE tokenizer (vocab $VOCAB_SIZE) -> $TOK_DIR"
    $PYTHON tools/train_tokenizer.py --input "$CORPUS" --output-dir "$TOK_DIR" --vocab-size "$VOCAB_SIZE"
fi

# 3. preprocess --------------------------------------------------------------------------------
if [[ -s "$DATA_PATH.bin" && -s "$DATA_PATH.idx" ]]; then
    log "tokenized data exists: $DATA_PATH.{bin,idx} (skipping)"
else
    log "tokenizing -> $DATA_PATH.{bin,idx}"
    $PYTHON tools/preprocess_data.py \
        --input "$CORPUS" --json-keys text --output-prefix "$DATA_PREFIX" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
        --append-eod --workers "$PREPROCESS_WORKERS" --log-interval 200
fi

# 4. train -------------------------------------------------------------------------------------
MODEL_ARGS=(
    --num-layers 2 --hidden-size 128 --num-attention-heads 4
    --seq-length 128 --max-position-embeddings 128
)
TRAIN_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS"
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.05
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --bf16 --use-distributed-optimizer --seed 1234
)
DATA_ARGS=(
    --data-path "$DATA_PATH" --split 949,50,1
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
)
OUTPUT_ARGS=(
    --log-interval 10 --eval-interval 50 --eval-iters 5
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 50
    --tensorboard-dir "$RUN_DIR/tensorboard"
)

log "training: $NPROC CPU processes, run dir $RUN_DIR"
set +e
$TORCHRUN --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --device cpu --distributed-backend gloo \
    "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
    "$@" 2>&1 | tee "$RUN_DIR/train.log"
rc=${PIPESTATUS[0]}
set -e

log "corpus:      $CORPUS"
log "tokenizer:   $VOCAB_FILE $MERGE_FILE"
log "data:        $DATA_PATH.{bin,idx}"
log "checkpoints: $RUN_DIR/checkpoints"
log "tensorboard: $RUN_DIR/tensorboard"
log "log:         $RUN_DIR/train.log"
if [[ $rc -ne 0 ]]; then
    log "training failed (exit code $rc)"
fi
exit "$rc"
