#!/usr/bin/env bash
# LoCo reproduction: Llama-2 style 0.8b (24 layers, hidden 1536, 12 heads, SwiGLU ffn 4096, RMSNorm, RoPE,
# untied embeddings, no linear biases), seq 2048, GBS 256, 57220 iterations (= 30B tokens, the
# token budget of the LoCo PR), lr 3e-4 -> 3e-5 cosine, 1% warm-up, micro-batch 4.
#
#   LOCO=1 bash examples/loco/run_0.8b.sh     # 4-bit gradients + LoCo error feedback (default)
#   LOCO=0 bash examples/loco/run_0.8b.sh     # full-precision gradient communication baseline
#   LOCO=0 QUANTIZED_GRADIENTS=1 bash examples/loco/run_0.8b.sh   # 4-bit gradients, no LoCo
#
# Other variables (DATA_PATH, TOKENIZER_MODEL, NNODES, GPUS_PER_NODE, DRY_RUN, ...): see
# examples/loco/README.md.  Launcher logic is shared with examples/sdp4bit/common.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../sdp4bit/common.sh"
recipe_init

MODEL_NAME=0.8b
NUM_LAYERS=24
HIDDEN_SIZE=1536
NUM_ATTENTION_HEADS=12
FFN_HIDDEN_SIZE=4096
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-4}
TRAIN_ITERS=${TRAIN_ITERS:-57220}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
RECIPE_EXTRA_ARGS=(--overlap-grad-reduce)

loco_recipe "$@"
