# Shared logic of the Mixture-of-Experts recipes in examples/moe/; sourced by run_*.sh after they
# define the model. The launcher, data, output and VARIANT handling are examples/sdp4bit/common.sh's
# (sourced here), so DRY_RUN=1, ECHO_ONLY=1, DATA_PATH=mock, ELASTIC=1 and the multi-node
# variables behave exactly as for the dense recipes.
#
# Functions:
#   moe_model_args -> fills MOE_ARGS from NUM_EXPERTS TOPK EP MOE_FFN_HIDDEN_SIZE AUX_LOSS_COEFF
#                     DISPATCHER GROUPED_GEMM (and TP: --sequence-parallel when TP > 1)
#   moe_recipe "$@" -> Mixtral-style GPT (RMSNorm, SwiGLU, RoPE, GQA, untied embeddings, no
#                     linear biases) with MoE layers; VARIANT selects the quantization as in
#                     examples/sdp4bit (baseline | qwd | tlq | tlq-hs | sdp4bit | qw | qwd-tlq)

source "$(dirname "${BASH_SOURCE[0]}")/../sdp4bit/common.sh"

moe_model_args() {
    NUM_EXPERTS=${NUM_EXPERTS:-8}
    TOPK=${TOPK:-2}
    EP=${EP:-8}
    MOE_ARGS=(
        --num-experts "$NUM_EXPERTS" --moe-router-topk "$TOPK" --expert-model-parallel-size "$EP"
        --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff "${AUX_LOSS_COEFF:-1e-2}"
        --moe-token-dispatcher-type "${DISPATCHER:-alltoall}"
    )
    if [[ -n "${MOE_FFN_HIDDEN_SIZE:-}" ]]; then
        MOE_ARGS+=(--moe-ffn-hidden-size "$MOE_FFN_HIDDEN_SIZE")
    fi
    case "${GROUPED_GEMM:-0}" in
        1) MOE_ARGS+=(--moe-grouped-gemm) ;;   # needs CUDA + Transformer Engine or grouped_gemm
        0) ;;
        *) recipe_die "GROUPED_GEMM must be 1 or 0, got '$GROUPED_GEMM'" ;;
    esac
    if (( ${TP:-1} > 1 )); then   # megatron-core's MoE layer with TP routes sequence-parallel slices
        MOE_ARGS+=(--sequence-parallel)
    fi
}

moe_recipe() {
    VARIANT=${VARIANT:-baseline}
    sdp4bit_variant_args "$VARIANT"
    llama_recipe_args
    MODEL_ARGS+=(--rotary-base 1000000 --group-query-attention --num-query-groups "$NUM_QUERY_GROUPS")
    moe_model_args
    RUN_DIR=${RUN_DIR:-runs/moe/mixtral-$MODEL_NAME-$VARIANT}
    recipe_output_args
    echo "[recipe] MoE Mixtral-style $MODEL_NAME ($NUM_EXPERTS experts top-$TOPK, EP $EP) variant=$VARIANT quantization: ${QUANT_ARGS[*]:-(none)}" >&2
    recipe_launch "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAIN_ARGS[@]}" "${SYSTEM_ARGS[@]}" \
        "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" ${QUANT_ARGS[@]+"${QUANT_ARGS[@]}"} "$@"
}
