#!/usr/bin/env bash
# Continue pretraining a Hugging Face model with SDP4Bit (4-bit weight + gradient communication,
# LoCo error feedback) on 2 CPU ranks, then export it back to Hugging Face.
#
#   bash examples/continue_pretraining/run.sh              # tiny random Llama, mock data
#   HF_DIR=/path/to/hf-model DATA_PATH=data/my_text_document bash examples/continue_pretraining/run.sh
#
# HF_DIR: a local HF model directory (GPT-2, Llama, Mistral, Qwen2); default: a tiny Llama built
# here from a config (random weights).  DATA_PATH: a preprocessed .bin/.idx prefix tokenized with
# that model's tokenizer (tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer
# --tokenizer-model $WORK/imported/tokenizer); default: --mock-data.
set -euo pipefail

PYTHON=${PYTHON:-python}
WORK=${WORK:-runs/continue_pretraining}
TRAIN_ITERS=${TRAIN_ITERS:-8}
SEQ_LENGTH=${SEQ_LENGTH:-64}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

if [[ -z "${HF_DIR:-}" ]]; then
  HF_DIR=$WORK/hf-tiny-llama
  "$PYTHON" "$REPO/examples/continue_pretraining/make_tiny_hf_model.py" --output "$HF_DIR"
fi

# 1. Import: our checkpoint (iteration 0), model_args.txt and the tokenizer, under $WORK/imported.
"$PYTHON" "$REPO/tools/checkpoint/convert_from_hf.py" --hf-dir "$HF_DIR" \
  --save "$WORK/imported" --seq-length "$SEQ_LENGTH" --force

# 2. Continue pretraining on 2 CPU ranks with SDP4Bit + LoCo (bf16: the quantized weight
#    gather needs separate fp32 master weights).
DATA=(--mock-data)
[[ -n "${DATA_PATH:-}" ]] && DATA=(--data-path "$DATA_PATH")
"$PYTHON" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 \
  --master-port "${MASTER_PORT:-29531}" "$REPO/pretrain_gpt.py" \
  --model-args-file "$WORK/imported/model_args.txt" --load "$WORK/imported" --finetune \
  --save "$WORK/continued" --save-interval "$TRAIN_ITERS" \
  --device cpu --bf16 --use-distributed-optimizer \
  --quantized-weights --quantized-gradients --hadamard-transform --loco \
  --micro-batch-size 2 --global-batch-size 8 --seq-length "$SEQ_LENGTH" \
  --train-iters "$TRAIN_ITERS" --lr 3e-4 --lr-decay-style constant \
  --log-interval 1 --eval-iters 0 "${DATA[@]}"

# 3. Export back to Hugging Face (the padding rows of the vocabulary are dropped again).
"$PYTHON" "$REPO/tools/checkpoint/convert_to_hf.py" --load "$WORK/continued" \
  --output "$WORK/hf-continued" --dtype fp32 --force
"$PYTHON" - "$WORK/hf-continued" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
model, tok = AutoModelForCausalLM.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
ids = tok("The quick brown fox", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
print(f"exported {type(model).__name__} (vocab {model.config.vocab_size}) loads with transformers; "
      f"greedy continuation ids: {out.tolist()}")
PY
