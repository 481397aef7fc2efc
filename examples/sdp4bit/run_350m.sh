#!/usr/bin/env bash
# SDP4Bit reproduction: GPT-350m (24 layers, hidden 1024, 16 heads), seq 2048, GBS 256,
# lr 3e-4 -> 3e-5 (cosine, 70k decay iters, 80k train iters, 1% warm-up), micro-batch 8.
# Model card from the SDP4Bit README (sdp4bit.md §8); the reference repo has no 350M script.
#
#   VARIANT=sdp4bit bash examples/sdp4bit/run_350m.sh [extra pretrain_gpt.py args]
#
# VARIANT = baseline | qwd | tlq | tlq-hs | sdp4bit | qw | qwd-tlq (default baseline).
# Other variables (DATA_PATH, VOCAB_FILE, MERGE_FILE, NNODES, GPUS_PER_NODE, DRY_RUN, ...):
# see examples/sdp4bit/README.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
recipe_init

MODEL_NAME=350m
NUM_LAYERS=24
HIDDEN_SIZE=1024
NUM_ATTENTION_HEADS=16
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
RECIPE_EXTRA_ARGS=()

sdp4bit_recipe "$@"
