#!/usr/bin/env bash
# Emulated two-node cluster on one machine: two network namespaces ("nodes") joined by one veth
# pair ("the inter-node link") whose egress is rate-limited with tc on both ends.
#
#   usage: setup_netns.sh up|down|status|check|unlimit|limit
#
#   unlimit  remove the root qdisc (tbf, and netem if any) from BOTH veth ends: the link then runs
#            at veth speed (no rate limit, no added delay). bench_emulated.py does this for the
#            `limit` variant only (the physical floor) and runs `limit` right after it.
#   limit    (re-)apply the shaping of `up` on both ends (replaces whatever root qdisc is there);
#            needs the same BANDWIDTH / LATENCY / BURST as `up`. Both print the resulting qdiscs
#            and fail if the result is not what was asked.
#
# Knobs (environment):
#   NS_PREFIX   namespace name prefix (default: emu$PPID) -> namespaces ${NS_PREFIX}n0, ${NS_PREFIX}n1
#   NS0/NS1     the namespace names themselves (override NS_PREFIX; bench_emulated.py passes them)
#   BANDWIDTH   per-direction link rate in tc syntax (default 1gbit; "0"/"none" = unshaped)
#   LATENCY     one-way delay added on each end (default 1ms; needs sch_netem, see below)
#   BURST       tbf bucket size (default 256kb)
#   MTU         veth MTU (default 1500, like ordinary Ethernet)
#   ADDR0/ADDR1 the two node addresses (default 10.77.0.1 / 10.77.0.2, /24)
#   IF0/IF1     the veth ends' names inside the namespaces (default emu0 / emu1)
#
# Latency needs the sch_netem qdisc.  Kernels without it (like the 6.18 kernel this was written on)
# get a warning and NO added delay; the link is then bandwidth-limited only (the effective RTT of
# the bare veth is ~0.05 ms).  `status` prints what was actually applied.
#
# Ranks inside the same namespace that talk to the namespace's own veth address never touch the
# veth: the kernel routes a packet to a local address through the `local` table onto `lo`
# (`ip route get $ADDR0` inside n0 prints "local 10.77.0.1 dev lo").  `check` verifies that.
set -euo pipefail

NS_PREFIX=${NS_PREFIX:-emu$PPID}
NS0=${NS0:-${NS_PREFIX}n0}
NS1=${NS1:-${NS_PREFIX}n1}
BANDWIDTH=${BANDWIDTH:-1gbit}
LATENCY=${LATENCY:-1ms}
BURST=${BURST:-256kb}
MTU=${MTU:-1500}
ADDR0=${ADDR0:-10.77.0.1}
ADDR1=${ADDR1:-10.77.0.2}
IF0=${IF0:-emu0}
IF1=${IF1:-emu1}
STATE_FILE=${STATE_FILE:-}

log() { echo "[setup_netns] $*" >&2; }

have_netem() {
  # Probe sch_netem in a scratch namespace (never touches the host's interfaces).
  local probe="${NS_PREFIX}probe"
  ip netns add "$probe" 2>/dev/null || return 1
  local ok=1
  if ip netns exec "$probe" tc qdisc add dev lo root netem delay 1ms >/dev/null 2>&1; then ok=0; fi
  ip netns del "$probe" 2>/dev/null || true
  return $ok
}

shape() {  # shape NS IF
  local ns=$1 dev=$2 parent="root"
  local delay_applied="none"
  if [[ -n "$LATENCY" && "$LATENCY" != "0" && "$LATENCY" != "0ms" && "$LATENCY" != "none" ]]; then
    if [[ "${NETEM_OK:-}" == 1 ]]; then
      ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$LATENCY"
      parent="parent 1:1"
      delay_applied="$LATENCY"
    fi
  fi
  if [[ -n "$BANDWIDTH" && "$BANDWIDTH" != "0" && "$BANDWIDTH" != "none" ]]; then
    # shellcheck disable=SC2086
    ip netns exec "$ns" tc qdisc add dev "$dev" $parent handle 10: tbf rate "$BANDWIDTH" \
      burst "$BURST" latency 50ms
  fi
  log "$ns/$dev: rate=${BANDWIDTH} delay=${delay_applied} mtu=${MTU}"
}

up() {
  if ip netns list | grep -qw "$NS0"; then log "$NS0 exists; run '$0 down' first"; exit 1; fi
  NETEM_OK=0
  if [[ -n "$LATENCY" && "$LATENCY" != "0" && "$LATENCY" != "0ms" && "$LATENCY" != "none" ]]; then
    if have_netem; then NETEM_OK=1; else
      log "WARNING: sch_netem is not available in this kernel: LATENCY=$LATENCY is NOT emulated" \
          "(bandwidth limit only)"
    fi
  fi
  ip netns add "$NS0"
  ip netns add "$NS1"
  # Create the pair directly inside the namespaces: no name is ever used in the host namespace.
  ip link add "$IF0" netns "$NS0" mtu "$MTU" type veth peer name "$IF1" netns "$NS1" mtu "$MTU"
  ip -n "$NS0" addr add "$ADDR0/24" dev "$IF0"
  ip -n "$NS1" addr add "$ADDR1/24" dev "$IF1"
  for ns in "$NS0" "$NS1"; do ip -n "$ns" link set lo up; done
  ip -n "$NS0" link set "$IF0" up
  ip -n "$NS1" link set "$IF1" up
  shape "$NS0" "$IF0"
  shape "$NS1" "$IF1"
  if [[ -n "$STATE_FILE" ]]; then
    printf 'NS0=%s\nNS1=%s\nIF0=%s\nIF1=%s\nADDR0=%s\nADDR1=%s\nBANDWIDTH=%s\nLATENCY=%s\nLATENCY_APPLIED=%s\nMTU=%s\n' \
      "$NS0" "$NS1" "$IF0" "$IF1" "$ADDR0" "$ADDR1" "$BANDWIDTH" "$LATENCY" \
      "$([[ $NETEM_OK == 1 ]] && echo "$LATENCY" || echo none)" "$MTU" > "$STATE_FILE"
  fi
  log "up: $NS0($IF0 $ADDR0) <-> $NS1($IF1 $ADDR1)"
}

down() {
  for ns in "$NS0" "$NS1" "${NS_PREFIX}probe"; do
    if ip netns list | grep -qw "$ns"; then
      # Kill anything we left running inside (only processes in *our* namespaces).
      local pids; pids=$(ip netns pids "$ns" 2>/dev/null || true)
      if [[ -n "$pids" ]]; then kill $pids 2>/dev/null || true; sleep 1; kill -9 $pids 2>/dev/null || true; fi
      ip netns del "$ns" && log "deleted $ns"
    fi
  done
}

status() {
  for pair in "$NS0:$IF0" "$NS1:$IF1"; do
    local ns=${pair%%:*} dev=${pair##*:}
    echo "== $ns"
    ip -n "$ns" -br addr
    ip netns exec "$ns" tc -s qdisc show dev "$dev"
  done
}

netem_state() {
  # NETEM_OK for limit: what `up` recorded in STATE_FILE (LATENCY_APPLIED), else probe again.
  NETEM_OK=0
  if [[ -z "$LATENCY" || "$LATENCY" == "0" || "$LATENCY" == "0ms" || "$LATENCY" == "none" ]]; then return; fi
  local applied=""
  if [[ -n "$STATE_FILE" && -s "$STATE_FILE" ]]; then
    applied=$(sed -n 's/^LATENCY_APPLIED=//p' "$STATE_FILE" | head -1)
  fi
  if [[ -n "$applied" ]]; then
    if [[ "$applied" != none ]]; then NETEM_OK=1; fi
  elif have_netem; then
    NETEM_OK=1
  fi
}

qdisc_line() {  # qdisc_line NS IF: the root qdisc(s) of the veth end, one line
  ip netns exec "$1" tc qdisc show dev "$2" | tr '\n' ';' | sed 's/;$//'
}

unlimit() {
  local ns dev
  for pair in "$NS0:$IF0" "$NS1:$IF1"; do
    ns=${pair%%:*}; dev=${pair##*:}
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    local q; q=$(qdisc_line "$ns" "$dev")
    echo "$ns/$dev: $q"
    if grep -Eq 'tbf|netem' <<< "$q"; then log "unlimit: $ns/$dev still shaped: $q"; exit 1; fi
  done
  log "unlimit: no rate limit and no added delay on $NS0/$IF0 <-> $NS1/$IF1"
}

limit() {
  local ns dev
  netem_state
  for pair in "$NS0:$IF0" "$NS1:$IF1"; do
    ns=${pair%%:*}; dev=${pair##*:}
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    shape "$ns" "$dev"
    local q; q=$(qdisc_line "$ns" "$dev")
    echo "$ns/$dev: $q"
    if [[ -n "$BANDWIDTH" && "$BANDWIDTH" != "0" && "$BANDWIDTH" != "none" ]] && ! grep -q tbf <<< "$q"; then
      log "limit: no tbf on $ns/$dev: $q"; exit 1
    fi
  done
}

check() {
  # The intra-namespace path: a packet to the namespace's own veth address goes over lo.
  echo "$NS0: $(ip netns exec "$NS0" ip route get "$ADDR0" | head -1)"
  echo "$NS1: $(ip netns exec "$NS1" ip route get "$ADDR1" | head -1)"
  echo "$NS0 -> $NS1: $(ip netns exec "$NS0" ip route get "$ADDR1" | head -1)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  check) check ;;
  unlimit) unlimit ;;
  limit) limit ;;
  *) echo "usage: $0 up|down|status|check|unlimit|limit" >&2; exit 2 ;;
esac
