#!/usr/bin/env bash
# Emulated two-node cluster benchmark: baselines vs SDP4Bit over a tc-limited veth link.
#
#   sudo bash bench/emulated_network/run_bench.sh                 # defaults below
#   BANDWIDTH=200mbit REPEATS=3 bash bench/emulated_network/run_bench.sh
#   BANDWIDTH=500mbit MODEL=medium ITERS=10 bash bench/emulated_network/run_bench.sh
#   MODE=collectives bash bench/emulated_network/run_bench.sh     # no trainer needed
#
# Knobs (environment):
#   BANDWIDTH  link rate per direction, tc syntax (default 1gbit)
#   LATENCY    one-way delay per end (default 1ms; only applied where sch_netem exists)
#   MODEL      tiny | small | medium | moe-small GPT preset (default small, ~16.8M params; medium ~34.8M;
#              moe-small: 8 experts top-2 at EP 2, ~20.0M; seq 8, micro-batch 1)
#   SEQ        override the preset's sequence length
#   MODE       train (pretrain_gpt.py) | collectives (bench_collectives.py)   (default train)
#   VARIANTS   run in this order, in one invocation. train default:
#                baseline,baseline-bf16,sdp4bit,sdp4bit-overlap,limit
#              baseline        megatron-core default (gloo all-reduce-based reduce-scatter, fp32 grads)
#              baseline-bf16   strongest unquantized peer: bf16 grads, exact ring-volume reduce-scatter
#                              (ring_volume_rs.py, BF16_RS_ALGO), --grad-reduce-in-bf16
#                              --overlap-grad-reduce --overlap-param-gather
#                              --overlap-param-gather-with-optimizer-step --ddp-bucket-size $BUCKET_SIZE
#              sdp4bit         SDP4Bit (8-bit intra / 4-bit inter gradients, 4-bit weights), no overlap
#              sdp4bit-overlap SDP4Bit + --grad-accum-dtype bf16 + --overlap-grad-reduce --overlap-param-gather
#                              --overlap-param-gather-with-optimizer-step
#                              --ddp-bucket-size $BUCKET_SIZE --gradient-alltoall-pipeline $PIPELINE
#              limit           sdp4bit-overlap with the tc qdiscs REMOVED from both veth ends for its
#                              run only (setup_netns.sh unlimit, then limit): the physical floor
#              also: sdp4bit-torch (SDP4Bit with QUANT_KERNELS=torch, the torch reference quantizer),
#              baseline-a2a / baseline-ring (fp32 ring-volume reduce-scatter baselines, no overlap).
#              collectives default: baseline,sdp4bit
#   REPEATS    run the whole VARIANTS list this many times back to back (default 1); the table
#              gives each invocation's ms/iter with its 1-min load average, and the median
#   BUCKET_SIZE --ddp-bucket-size of the overlap variants, elements (default 4000000: ~4 buckets
#              for the small model)
#   PIPELINE   --gradient-alltoall-pipeline of sdp4bit-overlap / limit (default 2)
#   BF16_RS_ALGO ring (default; NCCL's algorithm, fewest bytes across the link) | a2a
#   ITERS      training iterations / timed steps (default 8);  WARMUP (default 2)
#   NUMEL      collectives mode: elements (default: the MODEL's parameter count)
#   TIMEOUT    seconds per variant and invocation (default 600);  THREADS per rank (default 1)
#   MTU        veth MTU (default 1500);  OUT  report path (default bench/out/emulated_network.md)
#   TRAIN_EXTRA extra pretrain_gpt.py flags for every variant
# Needs root (ip netns, tc). Namespaces are always removed on exit.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"

export BANDWIDTH=${BANDWIDTH:-1gbit}
export LATENCY=${LATENCY:-1ms}
export MTU=${MTU:-1500}
MODEL=${MODEL:-small}
MODE=${MODE:-train}
if [[ $MODE == train ]]; then
  VARIANTS=${VARIANTS:-baseline,baseline-bf16,sdp4bit,sdp4bit-overlap,limit}
else
  VARIANTS=${VARIANTS:-baseline,sdp4bit}
fi
REPEATS=${REPEATS:-1}
BUCKET_SIZE=${BUCKET_SIZE:-4000000}
PIPELINE=${PIPELINE:-2}
BF16_RS_ALGO=${BF16_RS_ALGO:-ring}
ITERS=${ITERS:-8}
WARMUP=${WARMUP:-2}
TIMEOUT=${TIMEOUT:-600}
THREADS=${THREADS:-1}
OUT=${OUT:-$ROOT/bench/out/emulated_network.md}
export NS_PREFIX=${NS_PREFIX:-emu$$}
export ADDR0=10.77.0.1 ADDR1=10.77.0.2 IF0=emu0 IF1=emu1
NS0=${NS_PREFIX}n0; NS1=${NS_PREFIX}n1
STATE_FILE=$(mktemp); export STATE_FILE

if [[ $EUID -ne 0 ]]; then echo "run_bench.sh needs root (ip netns / tc)" >&2; exit 2; fi
cleanup() { bash "$HERE/setup_netns.sh" down || true; rm -f "$STATE_FILE"; }
trap cleanup EXIT
trap 'exit 130' INT TERM

bash "$HERE/setup_netns.sh" up
# shellcheck disable=SC1090
source "$STATE_FILE"

echo "== routes (same-namespace traffic to the own veth address goes over lo):"
bash "$HERE/setup_netns.sh" check

# --- link check: TCP throughput across the veth, and that same-namespace traffic skips it ------
PROBE_MB=${PROBE_MB:-48}
echo "== bandwidth check: $PROBE_MB MiB $NS0 -> $NS1"
timeout 120 ip netns exec "$NS1" python3 "$HERE/netcheck.py" server "$ADDR1" 5299 > "$STATE_FILE.srv" &
SRV=$!
sleep 0.5
CLIENT=$(timeout 120 ip netns exec "$NS0" python3 "$HERE/netcheck.py" client "$ADDR1" 5299 "$PROBE_MB")
wait $SRV || true
INTER_MBS=$(python3 -c 'import json,sys; print("%.1f" % json.loads(sys.argv[1])["MB_per_s"])' "$CLIENT")
echo "   inter-namespace TCP: $INTER_MBS MB/s (limit $BANDWIDTH)"
TX0=$(ip netns exec "$NS0" cat /sys/class/net/$IF0/statistics/tx_bytes)
timeout 120 ip netns exec "$NS0" python3 "$HERE/netcheck.py" server "$ADDR0" 5298 > "$STATE_FILE.srv" &
SRV=$!
sleep 0.5
INTRA=$(timeout 120 ip netns exec "$NS0" python3 "$HERE/netcheck.py" client "$ADDR0" 5298 256)
wait $SRV || true
TX1=$(ip netns exec "$NS0" cat /sys/class/net/$IF0/statistics/tx_bytes)
INTRA_MBS=$(python3 -c 'import json,sys; print("%.0f" % json.loads(sys.argv[1])["MB_per_s"])' "$INTRA")
echo "   same-namespace TCP via $ADDR0: $INTRA_MBS MB/s, veth $IF0 tx grew by $((TX1 - TX0)) bytes for 256 MiB"
rm -f "$STATE_FILE.srv"
LINK_INFO="tc tbf rate $BANDWIDTH per direction, added delay: ${LATENCY_APPLIED} (requested $LATENCY), MTU $MTU; measured TCP $INTER_MBS MB/s across, same-namespace $INTRA_MBS MB/s via lo (veth tx +$((TX1 - TX0)) B for 256 MiB)"

CMD=(python3 "$HERE/bench_emulated.py" --mode "$MODE" --variants "$VARIANTS"
     --namespaces "$NS0,$NS1" --ifnames "$IF0,$IF1" --master-addr "$ADDR0"
     --model "$MODEL" --iters "$ITERS" --warmup "$WARMUP" --timeout "$TIMEOUT"
     --threads "$THREADS" --out "$OUT" --link-info "$LINK_INFO"
     --repeats "$REPEATS" --bucket-size "$BUCKET_SIZE" --pipeline "$PIPELINE"
     --bf16-rs-algo "$BF16_RS_ALGO" --bandwidth "$BANDWIDTH"
     --link-script "$HERE/setup_netns.sh")
[[ -n "${NUMEL:-}" ]] && CMD+=(--numel "$NUMEL")
[[ -n "${SEQ:-}" ]] && CMD+=(--seq-length "$SEQ")
[[ -n "${TRAIN_EXTRA:-}" ]] && CMD+=(--train-extra "$TRAIN_EXTRA")
echo "== ${CMD[*]}"
"${CMD[@]}"
