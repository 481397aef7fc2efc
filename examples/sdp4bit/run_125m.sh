#!/usr/bin/env bash
# SDP4Bit reproduction: GPT-125m (12 layers, hidden 768, 12 heads), seq 2048, GBS 256,
# lr 6e-4 -> 6e-5 (cosine, 70k decay iters, 80k train iters, 1% warm-up), micro-batch 8.
# Model card from the SDP4Bit README (sdp4bit.md §8); reference scripts: accuracy/125M/*.
#
#   VARIANT=sdp4bit bash examples/sdp4bit/run_125m.sh [extra pretrain_gpt.py args]
#
# VARIANT = baseline | qwd | tlq | tlq-hs | sdp4bit | qw | qwd-tlq (default baseline).
# Other variables (DATA_PATH, VOCAB_FILE, MERGE_FILE, NNODES, GPUS_PER_NODE, DRY_RUN, ...):
# see examples/sdp4bit/README.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
recipe_init

MODEL_NAME=125m
NUM_LAYERS=12
HIDDEN_SIZE=768
NUM_ATTENTION_HEADS=12
LR=${LR:-6e-4}
MIN_LR=${MIN_LR:-6e-5}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-8}
RECIPE_EXTRA_ARGS=()

sdp4bit_recipe "$@"
