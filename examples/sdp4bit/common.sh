# Shared launcher logic for the recipes in examples/sdp4bit/ and examples/loco/.
# Sourced (not executed) by run_*.sh after they define the model; not meant to be run directly.
#
# Functions:
#   recipe_init                  -> cd to the repository root, set ROOT/PYTHON
#   sdp4bit_variant_args VARIANT -> fills QUANT_ARGS for baseline|qwd|tlq|tlq-hs|sdp4bit|qw|qwd-tlq
#   recipe_data_args             -> fills DATA_ARGS from DATA_PATH / VOCAB_FILE / MERGE_FILE / ...
#   recipe_launch ARGS...        -> torchrun (multi-node aware) pretrain_gpt.py ARGS, or
#                                   DRY_RUN=1: plain python with --dry-run, or
#                                   ECHO_ONLY=1: print the command and exit 0.
#
# Environment (all optional):
#   Launcher : GPUS_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT (else taken from SLURM_*,
#              falling back to a single local node)
#   Data     : DATA_PATH (path prefix(es) of .bin/.idx, or "mock" for --mock-data; DRY_RUN=1
#              without DATA_PATH uses mock)
#              TOKENIZER_TYPE VOCAB_FILE MERGE_FILE TOKENIZER_MODEL VOCAB_SIZE (NullTokenizer/mock)
#   Outputs  : RUN_DIR (runs/<family>/<name>)  SAVE_INTERVAL  LOG_INTERVAL  EVAL_INTERVAL  EVAL_ITERS
#   Modes    : DRY_RUN=1  ECHO_ONLY=1  PYTHON (python)
#   Elastic  : ELASTIC=1 -> torchrun with c10d rendezvous at MASTER_ADDR:MASTER_PORT
#              (--rdzv-id RDZV_ID, else SLURM_JOB_ID, else the run's name), --nnodes
#              MIN_NNODES:NNODES (MIN_NNODES defaults to NNODES), --max-restarts MAX_RESTARTS (3),
#              and --ckpt-format torch_dist (a restart on fewer nodes reshards the checkpoint).
#              A lost worker or node restarts every worker from the last checkpoint; see
#              examples/sdp4bit/sbatch_elastic.sh for SLURM (--requeue, srun torchrun).

recipe_init() {
    ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
    cd "$ROOT"
    PYTHON=${PYTHON:-python}
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
}

recipe_die() {
    echo "[recipe] error: $*" >&2
    exit 2
}

# SDP4Bit variants, flags exactly as the reference sample scripts (sdp4bit.md §1.3).
SDP4BIT_QWD_ARGS=(--quantized-weights --weight-quantization-bits 4 --wq-group-size 2048)
SDP4BIT_QW_ARGS=(--quantized-weights --weight-quantization-mode direct --weight-quantization-bits 4 --wq-group-size 2048)
SDP4BIT_TLQ_ARGS=(--quantized-gradients --gq-group-size-inter 128 --gradient-quantization-bits-inter 4
                  --gq-group-size-intra 128 --gradient-quantization-bits-intra 8)

sdp4bit_variant_args() {
    local variant=$1
    QUANT_ARGS=()
    case "$variant" in
        baseline) ;;
        qwd)      QUANT_ARGS=("${SDP4BIT_QWD_ARGS[@]}") ;;
        qw)       QUANT_ARGS=("${SDP4BIT_QW_ARGS[@]}") ;;
        tlq)      QUANT_ARGS=("${SDP4BIT_TLQ_ARGS[@]}") ;;
        tlq-hs)   QUANT_ARGS=("${SDP4BIT_TLQ_ARGS[@]}" --hadamard-transform) ;;
        sdp4bit)  QUANT_ARGS=("${SDP4BIT_QWD_ARGS[@]}" "${SDP4BIT_TLQ_ARGS[@]}" --hadamard-transform) ;;
        qwd-tlq)  QUANT_ARGS=("${SDP4BIT_QWD_ARGS[@]}" "${SDP4BIT_TLQ_ARGS[@]}") ;;
        *) recipe_die "unknown VARIANT='$variant' (choose baseline|qwd|tlq|tlq-hs|sdp4bit|qw|qwd-tlq)" ;;
    esac
}

# Fills DATA_ARGS.  Defaults for the tokenizer come from the caller:
#   DEFAULT_DATA_PATH DEFAULT_TOKENIZER_TYPE DEFAULT_VOCAB_FILE DEFAULT_MERGE_FILE
#   DEFAULT_TOKENIZER_MODEL DEFAULT_VOCAB_SIZE
recipe_data_args() {
    # A dry run only parses and builds configs: without an explicit DATA_PATH it must not need the
    # default corpus or tokenizer files on disk, so it uses mock data (and NullTokenizer, below).
    if [[ -z "${DATA_PATH:-}" && "${DRY_RUN:-0}" == 1 ]]; then
        DATA_PATH=mock
        echo "[recipe] note: DRY_RUN=1 without DATA_PATH: using DATA_PATH=mock (set DATA_PATH to dry-run real data)" >&2
    fi
    DATA_PATH=${DATA_PATH:-$DEFAULT_DATA_PATH}
    TOKENIZER_TYPE=${TOKENIZER_TYPE:-$DEFAULT_TOKENIZER_TYPE}
    VOCAB_FILE=${VOCAB_FILE:-${DEFAULT_VOCAB_FILE:-}}
    MERGE_FILE=${MERGE_FILE:-${DEFAULT_MERGE_FILE:-}}
    TOKENIZER_MODEL=${TOKENIZER_MODEL:-${DEFAULT_TOKENIZER_MODEL:-}}
    VOCAB_SIZE=${VOCAB_SIZE:-${DEFAULT_VOCAB_SIZE:-}}
    DATA_ARGS=()
    if [[ "$DATA_PATH" == mock ]]; then
        DATA_ARGS+=(--mock-data)
        # Mock data needs no real vocabulary: fall back to NullTokenizer when files are absent.
        local have_tok=0
        case "$TOKENIZER_TYPE" in
            GPT2BPETokenizer) [[ -f "$VOCAB_FILE" && -f "$MERGE_FILE" ]] && have_tok=1 ;;
            NullTokenizer) ;;
            *) [[ -e "$TOKENIZER_MODEL" ]] && have_tok=1 ;;
        esac
        if [[ $have_tok == 0 ]]; then
            TOKENIZER_TYPE=NullTokenizer
        fi
    else
        DATA_ARGS+=(--data-path $DATA_PATH --split "${SPLIT:-949,50,1}")
        if [[ "${DRY_RUN:-0}" != 1 && "${ECHO_ONLY:-0}" != 1 && "$DATA_PATH" != *" "* \
              && ! -f "$DATA_PATH.bin" ]]; then
            recipe_die "DATA_PATH=$DATA_PATH: $DATA_PATH.bin not found (make it with tools/preprocess_data.py, or use DATA_PATH=mock)"
        fi
    fi
    DATA_ARGS+=(--tokenizer-type "$TOKENIZER_TYPE")
    case "$TOKENIZER_TYPE" in
        GPT2BPETokenizer) DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE") ;;
        NullTokenizer)    DATA_ARGS+=(--vocab-size "${VOCAB_SIZE:-50257}") ;;
        *)                DATA_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL") ;;
    esac
}

# Output/logging args under RUN_DIR (caller sets RUN_DIR).
recipe_output_args() {
    OUTPUT_ARGS=(
        --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval "${SAVE_INTERVAL:-1000}"
        --tensorboard-dir "$RUN_DIR/tensorboard"
        --log-interval "${LOG_INTERVAL:-10}" --log-throughput
        --eval-interval "${EVAL_INTERVAL:-1000}" --eval-iters "${EVAL_ITERS:-10}"
    )
    if [[ "${ELASTIC:-0}" == 1 ]]; then   # loads on another data-parallel size
        OUTPUT_ARGS+=(--ckpt-format torch_dist)
    fi
}

# Multi-node torchrun launcher settings (SLURM aware).
recipe_launcher() {
    if [[ -z "${GPUS_PER_NODE:-}" ]]; then
        if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
            GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
        elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            GPUS_PER_NODE=$(nvidia-smi -L | wc -l)
        else
            GPUS_PER_NODE=8
        fi
    fi
    NNODES=${NNODES:-${SLURM_NNODES:-1}}
    NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        if [[ -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
            MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
        else
            MASTER_ADDR=localhost
        fi
    fi
    MASTER_PORT=${MASTER_PORT:-6000}
    if [[ "${ELASTIC:-0}" == 1 ]]; then
        # c10d rendezvous: no fixed node rank; every node names the same endpoint and id
        local min_nodes=${MIN_NNODES:-$NNODES}
        (( min_nodes >= 1 && min_nodes <= NNODES )) \
            || recipe_die "MIN_NNODES=$min_nodes must be between 1 and NNODES=$NNODES"
        # A store per rendezvous round: with torch's shared one, a node that joins a later round
        # than the first waits for a MASTER_ADDR its rank-0 agent never writes again, and the
        # whole job ends after the store timeout. (The trainer rendezvouses per attempt either
        # way: megatron/training/attempt.py.)
        export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
        echo "[recipe] ELASTIC=1: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" >&2
        LAUNCHER=(torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$min_nodes:$NNODES"
                  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
                  --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-$(basename "${RUN_DIR:-recipe}")}}"
                  --max-restarts "${MAX_RESTARTS:-3}")
    elif [[ "${ELASTIC:-0}" != 0 ]]; then
        recipe_die "ELASTIC must be 1 or 0, got '$ELASTIC'"
    else
        LAUNCHER=(torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
                  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
    fi
    if [[ -n "${TORCHRUN:-}" ]]; then
        read -r -a _tr <<<"$TORCHRUN"
        LAUNCHER=("${_tr[@]}" "${LAUNCHER[@]:1}")
    fi
}

# recipe_launch ARGS... : run pretrain_gpt.py with ARGS.
recipe_launch() {
    local cmd
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        # validate for the launch's world (NNODES x GPUS_PER_NODE), as rank 0 would see it:
        # the data-parallel size, batch divisibility and the two-level layout depend on it
        recipe_launcher
        export WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) LOCAL_WORLD_SIZE=$GPUS_PER_NODE RANK=0 LOCAL_RANK=0
        echo "[recipe] DRY_RUN=1: checking the arguments as rank 0 of $WORLD_SIZE ($NNODES node(s) x $GPUS_PER_NODE GPUs)" >&2
        cmd=("$PYTHON" pretrain_gpt.py "$@" --dry-run)
    else
        recipe_launcher
        cmd=("${LAUNCHER[@]}" pretrain_gpt.py "$@")
    fi
    echo "[recipe] ${cmd[*]}" >&2
    if [[ "${ECHO_ONLY:-0}" == 1 ]]; then
        printf '%s\n' "${cmd[*]}"
        return 0
    fi
    [[ "${DRY_RUN:-0}" == 1 ]] || mkdir -p "$RUN_DIR"
    exec "${cmd[@]}"
}

# Training arguments shared by all recipes (sdp4bit.md §1.3 common settings).
# Caller sets: NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS LR MIN_LR MICRO_BATCH_SIZE
#              optional FFN_HIDDEN_SIZE, RECIPE_EXTRA_ARGS (array), TRAIN_ITERS LR_DECAY_ITERS
recipe_common_args() {
    SEQ_LENGTH=${SEQ_LENGTH:-2048}
    MODEL_ARGS=(
        --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_ATTENTION_HEADS"
        --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
        --tensor-model-parallel-size "${TP:-1}" --pipeline-model-parallel-size "${PP:-1}"
    )
    if [[ -n "${FFN_HIDDEN_SIZE:-}" ]]; then
        MODEL_ARGS+=(--ffn-hidden-size "$FFN_HIDDEN_SIZE")
    fi
    TRAIN_ARGS=(
        --micro-batch-size "$MICRO_BATCH_SIZE" --global-batch-size "${GLOBAL_BATCH_SIZE:-256}"
        --train-iters "$TRAIN_ITERS" --lr-decay-iters "$LR_DECAY_ITERS"
        --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-fraction "${LR_WARMUP_FRACTION:-0.01}"
        --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0
        --bf16 --use-distributed-optimizer --seed "${SEED:-1234}"
    )
    # The reference scripts put these three in QUANTIZE_ARGS, also for the baselines.
    SYSTEM_ARGS=(--no-async-tensor-model-parallel-allreduce --recompute-activations --recompute-granularity selective)
    SYSTEM_ARGS+=(${RECIPE_EXTRA_ARGS[@]+"${RECIPE_EXTRA_ARGS[@]}"})
}

# sdp4bit_recipe "$@" : GPT recipe of the SDP4Bit paper; VARIANT selects the quantization.
sdp4bit_recipe() {
    VARIANT=${VARIANT:-baseline}
    sdp4bit_variant_args "$VARIANT"
    DEFAULT_DATA_PATH=data/pile/pile_gpt2_text_document
    DEFAULT_TOKENIZER_TYPE=GPT2BPETokenizer
    DEFAULT_VOCAB_FILE=data/gpt2/gpt2-vocab.json
    DEFAULT_MERGE_FILE=data/gpt2/gpt2-merges.txt
    DEFAULT_VOCAB_SIZE=50257
    recipe_data_args
    TRAIN_ITERS=${TRAIN_ITERS:-80000}
    LR_DECAY_ITERS=${LR_DECAY_ITERS:-70000}
    recipe_common_args
    RUN_DIR=${RUN_DIR:-runs/sdp4bit/gpt-$MODEL_NAME-$VARIANT}
    recipe_output_args
    echo "[recipe] SDP4Bit GPT-$MODEL_NAME variant=$VARIANT quantization: ${QUANT_ARGS[*]:-(none)}" >&2
    recipe_launch "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${SYSTEM_ARGS[@]}" "${DATA_ARGS[@]}" \
        "${OUTPUT_ARGS[@]}" ${QUANT_ARGS[@]+"${QUANT_ARGS[@]}"} "$@"
}

# llama_recipe_args : the Llama-2 data defaults (RedPajama, Llama-2 tokenizer, vocabulary 32000),
# then DATA_ARGS, the common arguments and the Llama model flags (RMSNorm, SwiGLU, RoPE, untied
# embeddings, no linear biases, no dropout) of the LoCo and MoE recipes.
llama_recipe_args() {
    DEFAULT_DATA_PATH=data/redpajama/redpajama_llama2_text_document
    DEFAULT_TOKENIZER_TYPE=HuggingFaceTokenizer
    DEFAULT_TOKENIZER_MODEL=data/llama2-tokenizer
    DEFAULT_VOCAB_SIZE=32000
    recipe_data_args
    recipe_common_args
    MODEL_ARGS+=(
        --normalization RMSNorm --swiglu --position-embedding-type rope
        --untie-embeddings-and-output-weights --disable-bias-linear
        --attention-dropout 0.0 --hidden-dropout 0.0
    )
}

# loco_recipe "$@" : Llama-2 style recipe of the LoCo PR; LOCO=1 (default) enables 4-bit
# quantized gradients with LoCo error feedback, LOCO=0 is the full-precision baseline
# (LOCO=0 QUANTIZED_GRADIENTS=1: 4-bit quantized gradients without error feedback).
LOCO_QUANT_ARGS=(--quantized-gradients --gradient-quantization-bits-intra 4 --gradient-quantization-bits-inter 4)
LOCO_ARGS=(--loco --loco-error-beta 0.8 --loco-reset-interval 1024)

loco_recipe() {
    LOCO=${LOCO:-1}
    QUANTIZED_GRADIENTS=${QUANTIZED_GRADIENTS:-0}
    case "$LOCO" in
        1) QUANT_ARGS=("${LOCO_QUANT_ARGS[@]}" "${LOCO_ARGS[@]}"); VARIANT=loco ;;
        0) if [[ "$QUANTIZED_GRADIENTS" == 1 ]]; then
               QUANT_ARGS=("${LOCO_QUANT_ARGS[@]}"); VARIANT=q4
           else
               QUANT_ARGS=(); VARIANT=baseline
           fi ;;
        *) recipe_die "LOCO must be 1 or 0, got '$LOCO'" ;;
    esac
    llama_recipe_args
    RUN_DIR=${RUN_DIR:-runs/loco/llama-$MODEL_NAME-$VARIANT}
    recipe_output_args
    echo "[recipe] LoCo Llama-$MODEL_NAME variant=$VARIANT quantization: ${QUANT_ARGS[*]:-(none)}" >&2
    recipe_launch "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${SYSTEM_ARGS[@]}" "${DATA_ARGS[@]}" \
        "${OUTPUT_ARGS[@]}" ${QUANT_ARGS[@]+"${QUANT_ARGS[@]}"} "$@"
}
