#!/usr/bin/env bash
# Mixtral-style MoE GPT for one node of 8 H100/H200: 24 layers, hidden 2048, 16 heads (GQA, 8 key/
# value groups), every layer an MoE layer of 8 SwiGLU experts (ffn 5632) with top-2 routing,
# RMSNorm, RoPE (base 1e6), untied embeddings, no linear biases, Llama-2 tokenizer (32000).
# 7.08B parameters in all (8 experts of 0.83B across the layers + 0.43B dense), 2.10B active per
# token. EP 8: each GPU of a node holds one expert of every layer (expert-data-parallel = nodes).
# seq 2048, GBS 256, micro-batch 2, lr 3e-4 -> 3e-5 cosine, 1% warm-up, aux loss 1e-2, alltoall
# token dispatch.
#
#   bash examples/moe/run_8x0.8b.sh                           # baseline
#   VARIANT=sdp4bit bash examples/moe/run_8x0.8b.sh           # qWD + TLq-HS (dense and expert buffers)
#   DRY_RUN=1 VARIANT=sdp4bit bash examples/moe/run_8x0.8b.sh # check the arguments, no GPU (mock data)
#
# VARIANT = baseline | qwd | tlq | tlq-hs | sdp4bit | qw | qwd-tlq (default baseline). Other
# variables (EP, TOPK, NUM_EXPERTS, GROUPED_GEMM, DATA_PATH, NNODES, DRY_RUN, ...): see
# examples/moe/README.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
recipe_init

MODEL_NAME=8x0.8b
NUM_LAYERS=24
HIDDEN_SIZE=2048
NUM_ATTENTION_HEADS=16
NUM_QUERY_GROUPS=8
FFN_HIDDEN_SIZE=5632
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-2}
TRAIN_ITERS=${TRAIN_ITERS:-50000}
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
RECIPE_EXTRA_ARGS=(--overlap-grad-reduce)

moe_recipe "$@"
