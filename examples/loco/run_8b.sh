#!/usr/bin/env bash
# LoCo reproduction: Llama-2 style 8b (32 layers, hidden 4096, 32 heads, SwiGLU ffn 11008, RMSNorm, RoPE,
# untied embeddings, no linear biases), seq 2048, GBS 256, 9537 iterations (= 5B tokens, the
# token budget of the LoCo PR), lr 1.5e-4 -> 1.5e-5 cosine, 1% warm-up, micro-batch 1.
#
#   LOCO=1 bash examples/loco/run_8b.sh     # 4-bit gradients + LoCo error feedback (default)
#   LOCO=0 bash examples/loco/run_8b.sh     # full-precision gradient communication baseline
#   LOCO=0 QUANTIZED_GRADIENTS=1 bash examples/loco/run_8b.sh   # 4-bit gradients, no LoCo
#
# Other variables (DATA_PATH, TOKENIZER_MODEL, NNODES, GPUS_PER_NODE, DRY_RUN, ...): see
# examples/loco/README.md.  Launcher logic is shared with examples/sdp4bit/common.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../sdp4bit/common.sh"
recipe_init

MODEL_NAME=8b
NUM_LAYERS=32
HIDDEN_SIZE=4096
NUM_ATTENTION_HEADS=32
FFN_HIDDEN_SIZE=11008
LR=${LR:-1.5e-4}
MIN_LR=${MIN_LR:-1.5e-5}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-1}
TRAIN_ITERS=${TRAIN_ITERS:-9537}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
RECIPE_EXTRA_ARGS=(--overlap-grad-reduce)

loco_recipe "$@"
