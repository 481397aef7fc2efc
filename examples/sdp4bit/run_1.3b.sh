#!/usr/bin/env bash
# SDP4Bit reproduction: GPT-1.3b (24 layers, hidden 2048, 16 heads), seq 2048, GBS 256,
# lr 2e-4 -> 2e-5 (cosine, 70k decay iters, 80k train iters, 1% warm-up), micro-batch 4.
# README model card says MBS 2; the reference script (accuracy/1_3B/grad_quant) uses 4 and --overlap-grad-reduce.
#
#   VARIANT=sdp4bit bash examples/sdp4bit/run_1.3b.sh [extra pretrain_gpt.py args]
#
# VARIANT = baseline | qwd | tlq | tlq-hs | sdp4bit | qw | qwd-tlq (default baseline).
# Other variables (DATA_PATH, VOCAB_FILE, MERGE_FILE, NNODES, GPUS_PER_NODE, DRY_RUN, ...):
# see examples/sdp4bit/README.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
recipe_init

MODEL_NAME=1.3b
NUM_LAYERS=24
HIDDEN_SIZE=2048
NUM_ATTENTION_HEADS=16
LR=${LR:-2e-4}
MIN_LR=${MIN_LR:-2e-5}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
RECIPE_EXTRA_ARGS=(--overlap-grad-reduce)

sdp4bit_recipe "$@"
