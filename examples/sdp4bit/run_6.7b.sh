#!/usr/bin/env bash
# SDP4Bit reproduction: GPT-6.7b (32 layers, hidden 4096, 32 heads), seq 2048, GBS 256,
# lr 1.2e-4 -> 1.2e-5 (cosine, 70k decay iters, 80k train iters, 1% warm-up), micro-batch 2.
# Reference accuracy scripts (accuracy/6_7B/*): TP=PP=1, MBS 2, --overlap-grad-reduce. The throughput runs used TP=4 (set TP=4).
#
#   VARIANT=sdp4bit bash examples/sdp4bit/run_6.7b.sh [extra pretrain_gpt.py args]
#
# VARIANT = baseline | qwd | tlq | tlq-hs | sdp4bit | qw | qwd-tlq (default baseline).
# Other variables (DATA_PATH, VOCAB_FILE, MERGE_FILE, NNODES, GPUS_PER_NODE, DRY_RUN, ...):
# see examples/sdp4bit/README.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
recipe_init

MODEL_NAME=6.7b
NUM_LAYERS=32
HIDDEN_SIZE=4096
NUM_ATTENTION_HEADS=32
LR=${LR:-1.2e-4}
MIN_LR=${MIN_LR:-1.2e-5}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-2}
RECIPE_EXTRA_ARGS=(--overlap-grad-reduce)

sdp4bit_recipe "$@"
