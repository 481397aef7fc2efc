#!/usr/bin/env bash
# Quickstart: end-to-end GPT pre-training on CPU, no internet needed -- the baseline, then SDP4Bit
# on the same data, side by side.
#
#   bash examples/quickstart.sh                       # baseline, then SDP4Bit; table + loss-curve PNG
#   bash examples/quickstart.sh --quantized-weights --quantized-gradients   # one run with your flags
#
# Steps (each is skipped when its output already exists, so the script can be rerun):
#   1. corpus     : Python standard-library sources -> data/quickstart/corpus.jsonl (~4 MB)
#   2. tokenizer  : byte-level BPE (vocab 8192)     -> data/quickstart/tokenizer/{vocab.json,merges.txt}
#   3. preprocess : megatron-core .bin/.idx          -> data/quickstart/stdlib_text_document.{bin,idx}
#   4. train      : torchrun, 2 CPU processes (gloo), tiny GPT -> runs/quickstart/<run name>/
#                   without arguments: "baseline" (megatron-core, bf16 wire), then "sdp4bit"
#                   (--quantized-weights --quantized-gradients --hadamard-transform, the 2 ranks
#                   as two one-GPU nodes: every byte crosses the "inter-node" link)
#   5. compare    : final losses and inter-node bits per element of both runs, and
#                   runs/quickstart/loss.png (tools/plot_logs.py)
#
# Extra arguments are passed through to pretrain_gpt.py (one run).  Environment overrides:
#   DATA_DIR (data/quickstart)  RUN_DIR (runs/quickstart/<name>)  RUN_NAME (baseline, or derived
#   from the extra args)  NPROC (2)  TRAIN_ITERS (100)  LOG_INTERVAL (10)  CORPUS_BYTES (4000000)
#   VOCAB_SIZE (8192)
#   PYTHON (python3)  TORCHRUN ("$PYTHON -m torch.distributed.run")  RUNS_ROOT (runs/quickstart)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# On a fresh machine, install what is missing first (torch==2.13.0, then requirements.txt),
# into the interpreter every step below runs (python3: a fresh machine may have no `python`).
PYTHON=${PYTHON:-python3}
PYTHON="$PYTHON" bash scripts/ensure_deps.sh

TORCHRUN=${TORCHRUN:-"$PYTHON -m torch.distributed.run"}
DATA_DIR=${DATA_DIR:-data/quickstart}
NPROC=${NPROC:-2}
TRAIN_ITERS=${TRAIN_ITERS:-100}
CORPUS_BYTES=${CORPUS_BYTES:-4000000}
VOCAB_SIZE=${VOCAB_SIZE:-8192}
PREPROCESS_WORKERS=${PREPROCESS_WORKERS:-2}
LOG_INTERVAL=${LOG_INTERVAL:-10}

RUNS_ROOT=${RUNS_ROOT:-runs/quickstart}

CORPUS="$DATA_DIR/corpus.jsonl"
TOK_DIR="$DATA_DIR/tokenizer"
VOCAB_FILE="$TOK_DIR/vocab.json"
MERGE_FILE="$TOK_DIR/merges.txt"
DATA_PREFIX="$DATA_DIR/stdlib"
DATA_PATH="${DATA_PREFIX}_text_document"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

log() { echo "[quickstart] $*" >&2; }

mkdir -p "$DATA_DIR"

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
    --log-interval "$LOG_INTERVAL" --eval-interval 50 --eval-iters 5 --save-interval 50
)

SDP4BIT_ARGS=(--quantized-weights --quantized-gradients --hadamard-transform
              --data-parallel-intra-node-size 1)

# train NAME RUN_DIR [pretrain_gpt.py flags...]: one run, its log and metrics in RUN_DIR.
train() {
    local name=$1 run_dir=$2
    shift 2
    if grep -qs "\"type\": \"summary\", \"iterations\": $TRAIN_ITERS," "$run_dir/metrics.jsonl"; then
        log "$name: finished run exists in $run_dir (skipping)"
        return
    fi
    mkdir -p "$run_dir"
    log "training $name: $NPROC CPU processes, run dir $run_dir"
    set +e
    $TORCHRUN --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
        --device cpu --distributed-backend gloo \
        "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" \
        --save "$run_dir/checkpoints" --load "$run_dir/checkpoints" \
        --tensorboard-dir "$run_dir/tensorboard" --jsonl-log "$run_dir/metrics.jsonl" \
        "$@" 2>&1 | tee "$run_dir/train.log"
    local rc=${PIPESTATUS[0]}
    set -e
    log "$name: log $run_dir/train.log, checkpoints $run_dir/checkpoints, tensorboard $run_dir/tensorboard"
    if [[ $rc -ne 0 ]]; then
        log "$name: training failed (exit code $rc)"
        exit "$rc"
    fi
}

log "data: $DATA_PATH.{bin,idx} (tokenizer $VOCAB_FILE $MERGE_FILE)"
if [[ $# -gt 0 ]]; then
    # One run with the user's flags, in a directory named after them (reruns resume it).
    if [[ -z "${RUN_NAME:-}" ]]; then
        RUN_NAME=$(printf '%s_' "$@" | sed -e 's/^--//' -e 's/_--/_/g' -e 's/[^A-Za-z0-9._=-]/-/g' -e 's/_$//' | cut -c1-120)
    fi
    train "$RUN_NAME" "${RUN_DIR:-$RUNS_ROOT/$RUN_NAME}" "$@"
    exit 0
fi

train baseline "$RUNS_ROOT/baseline"
train sdp4bit "$RUNS_ROOT/sdp4bit" "${SDP4BIT_ARGS[@]}"
log "baseline vs SDP4Bit (same data, seed and model):"
$PYTHON tools/plot_logs.py baseline="$RUNS_ROOT/baseline/metrics.jsonl" \
    sdp4bit="$RUNS_ROOT/sdp4bit/metrics.jsonl" --output "$RUNS_ROOT/loss.png" \
    --title "quickstart: baseline vs SDP4Bit (2 CPU ranks as 2 nodes)"
