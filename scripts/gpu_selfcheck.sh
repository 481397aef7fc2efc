#!/usr/bin/env bash
# The first command to run on a GPU machine: checks that everything verified on CPUs so far also
# holds on CUDA, and writes the findings as a markdown section for docs/performance.md.
#
#   bash scripts/gpu_selfcheck.sh              # on the GPU machine (CUDA torch already installed)
#   bash scripts/gpu_selfcheck.sh --dry-run    # anywhere: print every step's command; run the parts
#                                              # that need no GPU (flag parsing, tool plumbing)
#   bash scripts/gpu_selfcheck.sh --out FILE   # where the markdown goes
#                                              # (default runs/gpu_selfcheck/gpu_selfcheck.md)
#
# Steps (each logs to runs/gpu_selfcheck/<step>.log; without a CUDA device the run stops after
# step 1, otherwise a failed step does not stop the later ones; exit status 1 if any failed):
#   1 env          CUDA torch, GPUs, triton, megatron-core (steps 5-7 are skipped without it),
#                  Transformer Engine / apex present or not
#   2 aot          bench/triton_aot.py --quick for this GPU's arch (ptxas registers / spills)
#   3 kernel-tests tests/test_triton_kernels.py: it uses CUDA tensors by itself when torch sees a
#                  GPU (TRITON_INTERPRET unset), so the Triton kernels run compiled, bit-exact vs
#                  the torch reference
#   4 bench        bench/bench_quant.py on CUDA: GB/s per kernel and % of the measured
#                  device-to-device copy bandwidth (GPU time per call, kernels called as the
#                  trainer calls them; the host's enqueue time per call in its own column)
#   5 smoke        1-GPU pretrain_gpt.py, bf16, SDP4Bit flags, mock data, tiny GPT
#   6 nccl-vs-gloo with >= 4 GPUs: the same 4-rank SDP4Bit run (2 nodes x 2 GPUs:
#                  --data-parallel-intra-node-size 2, so both hops run), overlap flags and
#                  --gradient-alltoall-pipeline 2 on (CUDA communication streams), on NCCL (CUDA) and on gloo (CPU
#                  ranks, the path CI tests), deterministic (CPU init, no dropout, round to
#                  nearest, whose kernels are bit-identical across backends): per-iteration losses
#                  must agree within SELFCHECK_LOSS_RTOL (default 0.02 relative; what remains is
#                  GPU vs CPU bf16 matmul rounding and, when Transformer Engine is installed, TE
#                  layers on the CUDA side vs megatron-core's local ones on the CPU side).
#                  With fewer GPUs, where the loaded NCCL shares a GPU between ranks (>= 2.30 with
#                  NCCL_MULTI_RANK_GPU_ENABLE=1, e.g. .device/boot.sh's): the same 4 NCCL
#                  processes, placed on the GPUs modulo their count. Elsewhere (NCCL refuses two
#                  ranks on one GPU): bench/virtual_cuda_ranks.py,
#                  2x2 and 2x4 ranks as threads sharing the GPU (NCCL's stream semantics), the
#                  runtime's bucket calls with overlap, LoCo, qWD, a NaN step and a resume, bit for
#                  bit against the same ranks on the CPU, under set_sync_debug_mode("error")
#   7 throughput   bench/gpu_throughput.py: ms/iteration, TFLOP/s, peak memory of the recipe
#                  (baseline and SDP4Bit, 1 GPU, mock data, no recompute) against the plain PyTorch
#                  GPT of bench/reference_gpt.py, shape 125m (SELFCHECK_THROUGHPUT_SHAPES=
#                  125m,350m,1.3b for all three: an estimated 10-15 more minutes on an H100)
#
# Environment: PYTHON (python3), SELFCHECK_DIR (runs/gpu_selfcheck), SELFCHECK_ITERS (20),
# SELFCHECK_SIZES (16M,64M), SELFCHECK_LOSS_RTOL (0.02), SELFCHECK_THROUGHPUT_SHAPES (125m),
# SELFCHECK_THROUGHPUT_ITERS (10), SELFCHECK_STEP_TIMEOUT (900 s per step; the report is rewritten
# after every step, so a step stopped by the caller's own limit keeps the others'). The script's
# own variables are SC_*: none of them shadows an environment variable the steps' programs read (a
# shell variable CC=<compute capability> once replaced the exported C compiler, and Triton built
# its launcher with the "compiler" 90).
set -uo pipefail
SC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$SC_ROOT"
export PYTHONPATH="$SC_ROOT${PYTHONPATH:+:$PYTHONPATH}"

SC_DRY_RUN=0
SC_OUT=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) SC_DRY_RUN=1; shift ;;
        --out) [[ $# -ge 2 ]] || { echo "gpu_selfcheck: --out needs a file" >&2; exit 2; }
               SC_OUT=$2; shift 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_selfcheck: unknown argument '$1' (use --dry-run, --out FILE)" >&2; exit 2 ;;
    esac
done

PYTHON=${PYTHON:-python3}
SC_RUN_DIR=${SELFCHECK_DIR:-runs/gpu_selfcheck}
SC_ITERS=${SELFCHECK_ITERS:-20}
SC_SIZES=${SELFCHECK_SIZES:-16M,64M}
SC_RTOL=${SELFCHECK_LOSS_RTOL:-0.02}
SC_TP_SHAPES=${SELFCHECK_THROUGHPUT_SHAPES:-125m}
SC_TP_ITERS=${SELFCHECK_THROUGHPUT_ITERS:-10}
SC_STEP_TIMEOUT=${SELFCHECK_STEP_TIMEOUT:-900}
SC_OUT=${SC_OUT:-$SC_RUN_DIR/gpu_selfcheck.md}
mkdir -p "$SC_RUN_DIR" "$(dirname "$SC_OUT")"
# This run's logs only: the report quotes them.
rm -f "$SC_RUN_DIR"/{env,aot,kernel-tests,bench,smoke,nccl,gloo,virtual-ranks,throughput}.log "$SC_RUN_DIR/nccl-vs-gloo.md" \
      "$SC_RUN_DIR/throughput.json"
# The kernels must be compiled for the GPU, never interpreted; the dispatcher must pick Triton.
unset TRITON_INTERPRET QUANT_KERNELS

# A tiny GPT a GPU runs in seconds (and 2 CPU ranks in a minute, for the gloo side).
SC_MODEL=(--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128
       --max-position-embeddings 128 --micro-batch-size 4 --global-batch-size 8
       --mock-data --vocab-size 1024 --make-vocab-size-divisible-by 128
       --train-iters "$SC_ITERS" --lr 1e-3 --lr-warmup-iters 2 --log-interval 1 --log-throughput
       --eval-iters 0 --seed 1234)
SC_SDP4BIT=(--bf16 --use-distributed-optimizer --quantized-weights --quantized-gradients
         --hadamard-transform)
# Deterministic and backend-independent numerics for the NCCL vs gloo comparison.
SC_SAME_NUMERICS=(--use-cpu-initialization --attention-dropout 0 --hidden-dropout 0 --no-stochastic-rounding)

SC_STEPS=(env aot kernel-tests bench smoke nccl-vs-gloo throughput)
declare -A SC_STATUS SC_SECONDS_TAKEN SC_CMD SC_NOTE
SC_FAILED=0

log() { echo "[selfcheck] $*"; }

# record STEP STATUS NOTE (and rewrite the report: a step that hangs past the caller's own
# limit still leaves the finished steps' findings)
record() {
    SC_STATUS[$1]=$2
    SC_NOTE[$1]=${3:-}
    [[ $2 == FAIL ]] && SC_FAILED=1
    log "$1: $2${3:+ ($3)}"
    write_report
}

# shell_join ARGS...: the command as one copy-pastable line (quotes only where needed).
shell_join() {
    local a out=()
    for a in "$@"; do
        if [[ $a =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+=("$a"); else out+=("$(printf '%q' "$a")"); fi
    done
    echo "${out[*]}"
}

# run_step STEP[:LOG] CMD...: print the command; outside dry runs execute it with its output in
# $SC_RUN_DIR/LOG.log (LOG defaults to STEP) and show the tail. Returns the command's exit status.
run_step() {
    local step=${1%%:*} logname=${1#*:}; shift
    local idx=0 i
    for i in "${!SC_STEPS[@]}"; do [[ ${SC_STEPS[$i]} == "$step" ]] && idx=$((i + 1)); done
    SC_CMD[$step]="$(shell_join "$@")"
    log "step $idx/${#SC_STEPS[@]} $step: ${SC_CMD[$step]}"
    if [[ $SC_DRY_RUN == 1 ]]; then
        return 0
    fi
    local t0=$SECONDS rc
    timeout --kill-after=30 "$SC_STEP_TIMEOUT" "$@" > "$SC_RUN_DIR/$logname.log" 2>&1
    rc=$?
    if [[ $rc == 124 || $rc == 137 ]]; then
        echo "[selfcheck] $step: stopped after SELFCHECK_STEP_TIMEOUT=$SC_STEP_TIMEOUT s" >> "$SC_RUN_DIR/$logname.log"
    fi
    SC_SECONDS_TAKEN[$step]=$(( ${SC_SECONDS_TAKEN[$step]:-0} + SECONDS - t0 ))
    tail -n 15 "$SC_RUN_DIR/$logname.log" | sed 's/^/    /'
    return $rc
}

# write_report: the markdown section, from what is known so far.
write_report() {
    local s
    {
        echo "### GPU self-check ($(date -u '+%Y-%m-%d %H:%M UTC')$( [[ $SC_DRY_RUN == 1 ]] && echo ', DRY RUN: nothing measured'))"
        echo
        echo "\`bash scripts/gpu_selfcheck.sh$( [[ $SC_DRY_RUN == 1 ]] && echo ' --dry-run')\` on $(hostname): \`${SC_ENV_JSON:-torch did not import}\`"
        echo
        echo "| step | status | s | command / result |"
        echo "|---|---|---:|---|"
        for s in "${SC_STEPS[@]}"; do
            echo "| $s | ${SC_STATUS[$s]:-not run yet} | ${SC_SECONDS_TAKEN[$s]:--} | \`${SC_CMD[$s]:-}\`<br>${SC_NOTE[$s]:-} |"
        done
        if [[ $SC_DRY_RUN == 0 && -f $SC_RUN_DIR/bench.log ]]; then
            echo; echo "bench/bench_quant.py (\`%copy\` = moved bytes / device-to-device copy bandwidth):"
            echo; echo '```'; grep -v '^\s*$' "$SC_RUN_DIR/bench.log"; echo '```'
        fi
        if [[ $SC_DRY_RUN == 0 && -f $SC_RUN_DIR/aot.log ]]; then
            echo; echo "bench/triton_aot.py --quick on this GPU's arch:"
            echo; echo '```'; cat "$SC_RUN_DIR/aot.log"; echo '```'
        fi
        if [[ $SC_DRY_RUN == 0 && -f $SC_RUN_DIR/nccl-vs-gloo.md ]]; then
            echo; echo "NCCL (CUDA) vs gloo (CPU ranks), 4 ranks (2 x 2), SDP4Bit, round to nearest:"
            echo; cat "$SC_RUN_DIR/nccl-vs-gloo.md"
        fi
        if [[ $SC_DRY_RUN == 0 && -f $SC_RUN_DIR/virtual-ranks.log ]]; then
            echo; echo "Virtual ranks on one GPU vs the same ranks on the CPU (bench/virtual_cuda_ranks.py):"
            echo; echo '```'; grep '^\[virtual_cuda_ranks\]\|^MISMATCH' "$SC_RUN_DIR/virtual-ranks.log"; echo '```'
        fi
        if [[ $SC_DRY_RUN == 0 && -f $SC_RUN_DIR/throughput.log ]]; then
            echo; echo "bench/gpu_throughput.py (ours/reference = ms/iteration over the plain PyTorch GPT's):"
            echo; grep -E '^(gpu_throughput |\||[0-9a-z.]+: (parameters|micro-batch))' "$SC_RUN_DIR/throughput.log"
        fi
    } > "$SC_OUT"
}

free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Python helpers shared by the real run and the dry run (kept here: one file to copy to a GPU box).
read -r -d '' SC_PY_ENV <<'PY'
import importlib.util, json, sys
import torch
info = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "gpus": [], "capability": None}
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:  # reported, and step 2/3 will fail with the reason
    info["triton"] = f"not importable: {exc!r}"
if info["cuda_available"]:
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    major, minor = torch.cuda.get_device_capability(0)
    info["capability"] = major * 10 + minor
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:  # the trainer's own rule for several ranks on one GPU
        from megatron.training.initialize import ranks_can_share_a_gpu
        import os
        info["nccl_shares_gpu"] = ranks_can_share_a_gpu(tuple(torch.cuda.nccl.version()), os.environ)
    except Exception as exc:
        info["nccl_shares_gpu"] = False
        info["nccl_shares_gpu_error"] = repr(exc)
info["transformer_engine"] = importlib.util.find_spec("transformer_engine") is not None
info["apex"] = importlib.util.find_spec("apex") is not None
try:  # steps 5-7 train through it; its C++ dataset helpers must load on this Python
    import megatron.core
    from megatron.core.datasets import helpers_cpp  # noqa: F401
    info["megatron_core"] = megatron.core.__version__
except Exception as exc:
    info["megatron_core"] = f"not importable: {exc!r}"
print(json.dumps(info))
PY

# compare A.jsonl B.jsonl RTOL: per-iteration lm_loss of two --jsonl-log files.
read -r -d '' SC_PY_COMPARE <<'PY'
import json, math, sys
def losses(path):
    recs = [json.loads(l) for l in open(path, encoding="utf-8") if l.strip()]
    return {r["iteration"]: r["lm_loss"] for r in recs if r.get("type") == "train"}
a, b, rtol = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3])
its = sorted(set(a) & set(b))
if not its or set(a) != set(b):
    sys.exit(f"iterations differ: {sorted(a)} vs {sorted(b)}")
worst = max(abs(a[i] - b[i]) / abs(b[i]) for i in its)
bad = [i for i in its if not (math.isfinite(a[i]) and math.isfinite(b[i]))]
print("| iteration | NCCL (CUDA) | gloo (CPU) | rel. diff |")
print("|---:|---:|---:|---:|")
for i in its:
    print(f"| {i} | {a[i]:.4f} | {b[i]:.4f} | {abs(a[i] - b[i]) / abs(b[i]):.2e} |")
print(f"\nmax relative difference {worst:.2e} over {len(its)} iterations (tolerance {rtol:g})")
sys.exit(1 if bad or worst > rtol else 0)
PY

# Dry run of pretrain_gpt.py for several flag sets in one process: NAME WORLD ARGS... [:: ...]
read -r -d '' SC_PY_PARSE <<'PY'
import contextlib, io, json, os, sys
import pretrain_gpt
groups, cur = [], []
for tok in sys.argv[1:]:
    if tok == "::":
        groups.append(cur); cur = []
    else:
        cur.append(tok)
groups.append(cur)
failed = 0
for name, world, *argv in groups:
    os.environ.update(WORLD_SIZE=world, RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=world)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            rc = pretrain_gpt.main(argv + ["--dry-run"])
    except SystemExit as exc:
        rc = exc.code
    lines = {l.split(" ", 1)[0]: l.split(" ", 1)[1] for l in buf.getvalue().splitlines() if l.startswith("DRY_RUN_")}
    if rc or "DRY_RUN_QUANT" not in lines:
        failed = 1
        print(f"{name}: pretrain_gpt.py --dry-run failed (exit {rc})")
        continue
    q, a = json.loads(lines["DRY_RUN_QUANT"]), json.loads(lines["DRY_RUN_ARGS"])
    dev, backend = a["device"], a["distributed_backend"]
    bits = "%s/%s" % (q["gradient_quantization_bits_intra"], q["gradient_quantization_bits_inter"])
    print(f"{name}: flags parse (world {world}, device {dev}, backend {backend}, "
          f"qWD {q['quantized_weights']}, TLq {q['quantized_gradients']} {bits} bits, "
          f"Hadamard {q['hadamard_transform']}, stochastic rounding {q['stochastic_rounding']})")
sys.exit(failed)
PY

[[ $SC_DRY_RUN == 1 ]] && log "DRY RUN: commands are printed; only the CPU-capable parts run"
log "repository $SC_ROOT, logs in $SC_RUN_DIR, report $SC_OUT"

# ---- 1 env ------------------------------------------------------------------------------------
SC_ENV_JSON=""
SC_SM=90
SC_NGPU=0
SC_MCORE_OK=1
SC_NCCL_SHARES=0
SC_CMD[env]="$PYTHON -c <torch / triton / TE / apex probe>"
log "step 1/${#SC_STEPS[@]} env: ${SC_CMD[env]}"
if SC_ENV_JSON=$("$PYTHON" -c "$SC_PY_ENV" 2> "$SC_RUN_DIR/env.log"); then
    log "    $SC_ENV_JSON"
    read -r SC_CUDA_OK SC_NGPU SC_SM_FOUND SC_MCORE_OK SC_NCCL_SHARES < <("$PYTHON" -c 'import json, sys; d = json.loads(sys.argv[1]); print(int(d["cuda_available"]), len(d["gpus"]), d["capability"] or 0, int(not d["megatron_core"].startswith("not importable")), int(d.get("nccl_shares_gpu", False)))' "$SC_ENV_JSON")
    [[ $SC_SM_FOUND != 0 ]] && SC_SM=$SC_SM_FOUND
    if [[ $SC_DRY_RUN == 1 ]]; then
        record env DRY "$( [[ $SC_CUDA_OK == 1 ]] && echo "$SC_NGPU GPU(s), sm_$SC_SM" || echo "no CUDA device here; the real run stops at this step without one")"
    elif [[ $SC_CUDA_OK == 1 ]]; then
        record env PASS "$SC_NGPU GPU(s), sm_$SC_SM"
    else
        record env FAIL "torch sees no CUDA device (torch.version.cuda is null for a CPU build: install a CUDA torch first, see README '## GPUs')"
        log "stopping: every later step needs a GPU"
    fi
else
    cat "$SC_RUN_DIR/env.log"
    record env FAIL "torch does not import"
fi
if [[ ${SC_STATUS[env]} == FAIL ]]; then
    SC_STOP=1
else
    SC_STOP=0
fi

# ---- 2 aot ------------------------------------------------------------------------------------
if [[ $SC_STOP == 0 ]]; then
    if run_step aot "$PYTHON" bench/triton_aot.py --quick --targets "sm_$SC_SM"; then
        if [[ $SC_DRY_RUN == 1 ]]; then
            if out=$("$PYTHON" bench/triton_aot.py --quick --list --targets "sm_$SC_SM" 2>&1); then
                record aot DRY "specialisations found: $(echo "$out" | wc -l) (--list; compiling is left to the real run)"
            else
                echo "$out"; record aot FAIL "triton_aot.py --list failed"
            fi
        else
            record aot PASS "$(grep -m1 'compiles (' "$SC_RUN_DIR/aot.log")"
        fi
    else
        record aot FAIL "see $SC_RUN_DIR/aot.log"
    fi

    # ---- 3 kernel-tests -----------------------------------------------------------------------
    if run_step kernel-tests "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py; then
        if [[ $SC_DRY_RUN == 1 ]]; then
            if out=$("$PYTHON" -m pytest -q -p no:cacheprovider --collect-only tests/test_triton_kernels.py 2>&1); then
                record kernel-tests DRY "$(echo "$out" | grep -Eo '[0-9]+ tests? collected' | head -1) (CUDA tensors when torch.cuda.is_available())"
            else
                echo "$out" | tail -20; record kernel-tests FAIL "collection failed"
            fi
        else
            record kernel-tests PASS "$(grep -Eo '[0-9]+ passed[^=]*' "$SC_RUN_DIR/kernel-tests.log" | tail -1) on CUDA tensors"
        fi
    else
        record kernel-tests FAIL "see $SC_RUN_DIR/kernel-tests.log"
    fi

    # ---- 4 bench ------------------------------------------------------------------------------
    if run_step bench "$PYTHON" bench/bench_quant.py --sizes "$SC_SIZES" --device cuda --bits 4,8 --group-size 128; then
        if [[ $SC_DRY_RUN == 1 ]]; then
            if help=$("$PYTHON" bench/bench_quant.py --help 2>&1) && \
               grep -q -- --sizes <<< "$help" && grep -q -- --device <<< "$help" && \
               grep -q -- --bits <<< "$help" && grep -q -- --group-size <<< "$help"; then
                record bench DRY "bench_quant.py accepts --sizes --device --bits --group-size"
            else
                echo "$help" | tail -20; record bench FAIL "bench_quant.py does not accept the flags used"
            fi
        else
            record bench PASS "$(grep -m1 'device-to-device copy' "$SC_RUN_DIR/bench.log")"
        fi
    else
        record bench FAIL "see $SC_RUN_DIR/bench.log"
    fi

    if [[ $SC_MCORE_OK == 0 && $SC_DRY_RUN == 0 ]]; then
        for s in smoke nccl-vs-gloo throughput; do
            record "$s" SKIP "megatron-core is not importable here (see the env line): pip install megatron-core==0.16.1 for this Python"
        done
    else
    # ---- 5 smoke ------------------------------------------------------------------------------
    SC_SMOKE=("${SC_MODEL[@]}" "${SC_SDP4BIT[@]}" --data-parallel-intra-node-size 1 --device cuda
              --jsonl-log "$SC_RUN_DIR/smoke.jsonl")
    # Overlap on, several buckets, pipelined hops: on CUDA this exercises the communication
    # streams (megatron/distributed/quant/streams.py), on gloo the worker threads.
    SC_OVERLAP=(--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 200000
             --gradient-alltoall-pipeline 2)
    # 4 ranks as 2 nodes x 2 GPUs: the intra hop, the middle requantization and the inter hop run.
    SC_PAIR=("${SC_MODEL[@]}" "${SC_SDP4BIT[@]}" "${SC_SAME_NUMERICS[@]}" "${SC_OVERLAP[@]}"
             --data-parallel-intra-node-size 2 --global-batch-size 16)
    SC_VIRTUAL=("$PYTHON" bench/virtual_cuda_ranks.py --layouts 2x2,2x4 --steps 4)
    SC_NCCL_RUN=("${SC_PAIR[@]}" --device cuda --distributed-backend nccl --jsonl-log "$SC_RUN_DIR/nccl.jsonl")
    SC_GLOO_RUN=("${SC_PAIR[@]}" --device cpu --distributed-backend gloo --jsonl-log "$SC_RUN_DIR/gloo.jsonl")
    rm -f "$SC_RUN_DIR/smoke.jsonl" "$SC_RUN_DIR/nccl.jsonl" "$SC_RUN_DIR/gloo.jsonl"
    if ! run_step smoke "$PYTHON" -m torch.distributed.run --nproc-per-node 1 --master-addr 127.0.0.1 \
            --master-port "$(free_port)" pretrain_gpt.py "${SC_SMOKE[@]}"; then
        record smoke FAIL "see $SC_RUN_DIR/smoke.log"
    elif [[ $SC_DRY_RUN == 1 ]]; then
        # The flag sets of steps 5 and 6 parse and validate (pretrain_gpt.py --dry-run, one process).
        if out=$("$PYTHON" -c "$SC_PY_PARSE" smoke 1 "${SC_SMOKE[@]}" :: nccl 4 "${SC_NCCL_RUN[@]}" \
                    :: gloo 4 "${SC_GLOO_RUN[@]}" 2>&1); then
            echo "$out" | grep -E '^(smoke|nccl|gloo):' | sed 's/^/    /'
            record smoke DRY "the flags of steps 5 and 6 parse (pretrain_gpt.py --dry-run)"
        else
            echo "$out" | tail -30
            record smoke FAIL "pretrain_gpt.py --dry-run refused the flags"
        fi
    elif out=$("$PYTHON" - "$SC_RUN_DIR/smoke.jsonl" "$SC_ITERS" 2>&1 <<'PY'
import json, math, sys
recs = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8") if l.strip()]
train = [r for r in recs if r.get("type") == "train"]
assert len(train) == int(sys.argv[2]), f"{len(train)} train records, expected {sys.argv[2]}"
assert all(math.isfinite(r["lm_loss"]) for r in train), "non-finite loss"
tps = sorted(r["tokens_per_s"] for r in train[2:]) or [0.0]
print(f"loss {train[0]['lm_loss']:.4f} -> {train[-1]['lm_loss']:.4f} in {len(train)} iterations, "
      f"median {tps[len(tps) // 2]:.0f} tokens/s after 2 warm-up iterations")
PY
    ); then
        if grep -q "quantized communication off" "$SC_RUN_DIR/smoke.log"; then
            out+="; data-parallel size 1: the quantized collectives are off (megatron-core's exact path), step 6 runs them"
        fi
        record smoke PASS "$out"
    else
        record smoke FAIL "$(tail -1 <<< "$out")"
    fi

    # ---- 6 nccl-vs-gloo -----------------------------------------------------------------------
    if [[ $SC_DRY_RUN == 0 && $SC_NGPU -lt 4 && $SC_NCCL_SHARES == 0 ]]; then
        # This NCCL refuses two ranks on one GPU: the ranks run as threads sharing it instead.
        if run_step nccl-vs-gloo:virtual-ranks "${SC_VIRTUAL[@]}"; then
            record nccl-vs-gloo PASS "$SC_NGPU GPU(s) < 4 ranks: virtual ranks on one GPU, $(grep -c 'CUDA == CPU bit for bit' "$SC_RUN_DIR/virtual-ranks.log") layouts bit-identical to CPU"
        else
            record nccl-vs-gloo FAIL "virtual ranks: see $SC_RUN_DIR/virtual-ranks.log"
        fi
    else
        ok=1
        run_step nccl-vs-gloo:nccl "$PYTHON" -m torch.distributed.run --nproc-per-node 4 \
            --master-addr 127.0.0.1 --master-port "$(free_port)" pretrain_gpt.py "${SC_NCCL_RUN[@]}" || ok=0
        SC_NCCL_CMD=${SC_CMD[nccl-vs-gloo]}
        run_step nccl-vs-gloo:gloo env OMP_NUM_THREADS=2 "$PYTHON" -m torch.distributed.run \
            --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "$(free_port)" pretrain_gpt.py \
            "${SC_GLOO_RUN[@]}" || ok=0
        SC_CMD[nccl-vs-gloo]="$SC_NCCL_CMD; then the same with --device cpu --distributed-backend gloo"
        if [[ $SC_DRY_RUN == 1 ]]; then
            SC_CMD[nccl-vs-gloo]+="; with fewer than 4 GPUs: $(shell_join "${SC_VIRTUAL[@]}")"
            log "step 6/${#SC_STEPS[@]} nccl-vs-gloo: with fewer than 4 GPUs: $(shell_join "${SC_VIRTUAL[@]}")"
            # The comparison itself: identical logs pass, a 10 % gap fails.
            printf '{"type": "train", "iteration": 1, "lm_loss": 6.9}\n{"type": "train", "iteration": 2, "lm_loss": 6.5}\n' > "$SC_RUN_DIR/dry_a.jsonl"
            printf '{"type": "train", "iteration": 1, "lm_loss": 6.9}\n{"type": "train", "iteration": 2, "lm_loss": 7.15}\n' > "$SC_RUN_DIR/dry_b.jsonl"
            # ... and the virtual ranks' CPU side (what the GPU side is compared against) runs.
            if "$PYTHON" -c "$SC_PY_COMPARE" "$SC_RUN_DIR/dry_a.jsonl" "$SC_RUN_DIR/dry_a.jsonl" "$SC_RTOL" > /dev/null && \
               ! "$PYTHON" -c "$SC_PY_COMPARE" "$SC_RUN_DIR/dry_a.jsonl" "$SC_RUN_DIR/dry_b.jsonl" "$SC_RTOL" > /dev/null 2>&1 && \
               "$PYTHON" bench/virtual_cuda_ranks.py --device cpu --layouts 2x2 --steps 3 --numel 8192 \
                   > "$SC_RUN_DIR/virtual-ranks.log" 2>&1; then
                record nccl-vs-gloo DRY "loss comparison (rtol $SC_RTOL) accepts equal logs and rejects a 10% gap; virtual ranks' CPU side runs"
            else
                record nccl-vs-gloo FAIL "the loss comparison's self-test or the virtual ranks' CPU side failed"
            fi
            rm -f "$SC_RUN_DIR/dry_a.jsonl" "$SC_RUN_DIR/dry_b.jsonl"
        elif [[ $ok == 0 ]]; then
            record nccl-vs-gloo FAIL "a run failed: see $SC_RUN_DIR/nccl.log and $SC_RUN_DIR/gloo.log"
        elif "$PYTHON" -c "$SC_PY_COMPARE" "$SC_RUN_DIR/nccl.jsonl" "$SC_RUN_DIR/gloo.jsonl" "$SC_RTOL" > "$SC_RUN_DIR/nccl-vs-gloo.md" 2>&1; then
            record nccl-vs-gloo PASS "$( [[ $SC_NGPU -lt 4 ]] && echo "4 NCCL processes sharing $SC_NGPU GPU(s); ")$(tail -1 "$SC_RUN_DIR/nccl-vs-gloo.md")"
        else
            record nccl-vs-gloo FAIL "$(tail -1 "$SC_RUN_DIR/nccl-vs-gloo.md")"
        fi
    fi

    # ---- 7 throughput -------------------------------------------------------------------------
    SC_TP_ARGS=(--shapes "$SC_TP_SHAPES" --runs baseline,reference --iters "$SC_TP_ITERS" --warmup 3 --device cuda
                --work-dir "$SC_RUN_DIR/throughput" --out "$SC_RUN_DIR/throughput.json")
    if ! run_step throughput "$PYTHON" bench/gpu_throughput.py "${SC_TP_ARGS[@]}"; then
        record throughput FAIL "see $SC_RUN_DIR/throughput.log"
    elif [[ $SC_DRY_RUN == 1 ]]; then
        # Every run's command is built and its flags checked (pretrain_gpt.py --dry-run, the
        # reference's parser); nothing is trained.
        if out=$("$PYTHON" bench/gpu_throughput.py "${SC_TP_ARGS[@]}" --dry-run 2>&1); then
            record throughput DRY "$(tail -1 <<< "$out" | sed 's/^\[gpu_throughput\] //')"
        else
            echo "$out" | tail -30
            record throughput FAIL "gpu_throughput.py --dry-run refused the flags"
        fi
    elif out=$("$PYTHON" - "$SC_RUN_DIR/throughput.json" 2>&1 <<'PY'
import json, sys
rows = json.load(open(sys.argv[1], encoding="utf-8"))["rows"]
ratio = lambda r: "n/a" if r.get("ratio_to_reference") is None else f"{r['ratio_to_reference']:.2f}x"
print("; ".join(f"{r['shape']} {r['run']} {ratio(r)}" for r in rows if r["run"] != "reference")
      + " the reference's ms/iteration")
PY
    ); then
        record throughput PASS "$out"
    else
        record throughput FAIL "$(tail -1 <<< "$out")"
    fi
    fi
fi
for s in "${SC_STEPS[@]}"; do
    [[ -n ${SC_STATUS[$s]:-} ]] || record "$s" SKIP "not run: no GPU"
done

# ---- report -------------------------------------------------------------------------------------
write_report
log "report written to $SC_OUT"
if [[ $SC_FAILED == 1 ]]; then
    log "FAILED: $(for s in "${SC_STEPS[@]}"; do [[ ${SC_STATUS[$s]} == FAIL ]] && printf '%s ' "$s"; done)"
    exit 1
fi
log "all steps passed$( [[ $SC_DRY_RUN == 1 ]] && echo ' (dry run)')"
exit 0
