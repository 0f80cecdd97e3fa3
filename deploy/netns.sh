#!/usr/bin/env bash
# Three "machines" on this one: network namespaces pdserve-router, pdserve-decode and pdserve-prefill,
# joined by veth pairs to a bridge, each with its own address, running docs/deployment.md's commands for
# workers on separate machines. As root.
#
#   sudo deploy/netns.sh up                 # router 10.99.0.1, decode 10.99.0.2, prefill 10.99.0.3; CPU
#   sudo TRANSPORT=zmq MODE=layer MODEL=tiny deploy/netns.sh up
#   sudo deploy/netns.sh status             # /health as the router sees it (with the API key)
#   sudo deploy/netns.sh shape decode 100mbit   # tbf on both directions of the decode host's link
#   sudo deploy/netns.sh shape decode off
#   sudo deploy/netns.sh link decode down   # pull its cable (and `link decode up` to plug it back)
#   sudo deploy/netns.sh down               # stop everything, delete the namespaces and the bridge
#
# Then, from this machine (the bridge has 10.99.0.254):
#   curl http://10.99.0.1:8000/v1/completions -H "Authorization: Bearer $(cat /run/pdserve-netns/api-key)" \
#     -H 'Content-Type: application/json' -d '{"prompt": "The capital of France is", "max_tokens": 16, "policy": "disaggregated"}'
#
# Knobs: TRANSPORT (nixl | zmq; default nixl), MODE (bulk | layer), MODEL (smollm2-135m), SUBNET (10.99.0,
# the first three octets), RATE (e.g. 100mbit: shape the decode link at start), STATE (/run/pdserve-netns:
# keys, logs, pids), PDSERVE_BIN (the folder holding pdserve and pdserve-worker; default .venv/bin),
# EXTRA (more pdserve-worker flags). With nixl, the workers get UCX_TLS=tcp and UCX_NET_DEVICES=eth0:
# the namespaces share one kernel, and with UCX's defaults it would move the KV over cma (shared
# memory), never over the link; each worker's log names the lane UCX took ("goes over UCX tcp").
# tests/netns.py builds the same topology for the tests (tests/test_multihost.py).
set -euo pipefail
cd "$(dirname "$0")/.."
SUBNET=${SUBNET:-10.99.0}
STATE=${STATE:-/run/pdserve-netns}
BIN=${PDSERVE_BIN:-$PWD/.venv/bin}
TRANSPORT=${TRANSPORT:-nixl}
MODE=${MODE:-bulk}
MODEL=${MODEL:-smollm2-135m}
BRIDGE=pdsbr0
HOSTS=(router decode prefill)
declare -A IP=([router]=$SUBNET.1 [decode]=$SUBNET.2 [prefill]=$SUBNET.3)
declare -A VETH=([router]=pdsv-router [decode]=pdsv-decode [prefill]=pdsv-prefill)

die() { echo "netns.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "run as root (namespaces, veth and tc need it)"; }
in_ns() { local h=$1; shift; ip netns exec "pdserve-$h" "$@"; }

net_up() {
  ip link show "$BRIDGE" >/dev/null 2>&1 && die "$BRIDGE exists: already up? (deploy/netns.sh down first)"
  ip -4 -o addr | grep -q " $SUBNET\." && die "$SUBNET.0/24 is in use on this machine; pick another SUBNET="
  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for h in "${HOSTS[@]}"; do
    ip netns add "pdserve-$h"
    ip link add "${VETH[$h]}" type veth peer name eth0 netns "pdserve-$h"
    ip link set "${VETH[$h]}" master "$BRIDGE" up
    in_ns "$h" ip addr add "${IP[$h]}/24" dev eth0
    in_ns "$h" ip link set eth0 up
    in_ns "$h" ip link set lo up
  done
}

shape() {  # shape HOST RATE|off: tbf on both directions of HOST's link (netem is not needed)
  local h=$1 rate=$2
  for side in root ns; do
    local run=() dev=${VETH[$h]}
    [ "$side" = ns ] && run=(ip netns exec "pdserve-$h") && dev=eth0
    "${run[@]}" tc qdisc del dev "$dev" root 2>/dev/null || true
    [ "$rate" = off ] || "${run[@]}" tc qdisc add dev "$dev" root tbf rate "$rate" burst 64kb latency 200ms
  done
  echo "$h link: tbf $rate"
}

start() {  # start NAME HOST ENV... -- CMD...: in HOST's namespace, logging to $STATE/NAME.log
  local name=$1 host=$2; shift 2
  local env=()
  while [ "$1" != -- ]; do env+=("$1"); shift; done
  shift
  ip netns exec "pdserve-$host" env CUDA_VISIBLE_DEVICES= "${env[@]}" "$@" >"$STATE/$name.log" 2>&1 &
  echo $! >"$STATE/$name.pid"
  echo "started $name in pdserve-$host (pid $!): $*"
}

up() {
  need_root
  [ -x "$BIN/pdserve" ] || die "no $BIN/pdserve: run ./scripts/setup.sh (or set PDSERVE_BIN)"
  case $TRANSPORT in nixl|zmq) ;; *) die "TRANSPORT=$TRANSPORT: between hosts use nixl or zmq (ipc is one host only)";; esac
  mkdir -p "$STATE" && chmod 700 "$STATE"
  net_up
  [ -z "${RATE:-}" ] || shape decode "$RATE"
  local r=${IP[router]} d=${IP[decode]} p=${IP[prefill]} ucx=()
  [ "$TRANSPORT" = nixl ] && ucx=(UCX_TLS=tcp UCX_NET_DEVICES=eth0)
  rm -rf "$STATE/keys" && "$BIN/pdserve" keygen "$STATE/keys" >/dev/null
  [ -s "$STATE/api-key" ] || (umask 077 && openssl rand -hex 24 >"$STATE/api-key" 2>/dev/null ||
                               head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/api-key")
  # docs/deployment.md's commands for separate machines, one per "machine"
  start router router PDSERVE_API_KEY="$(cat "$STATE/api-key")" -- \
    "$BIN/pdserve" router --host "$r" --port 8000 --register "tcp://$r:7100" --keys "$STATE/keys/router" --model "$MODEL"
  start decode decode "${ucx[@]}" -- \
    "$BIN/pdserve-worker" --role decode --device cpu --model "$MODEL" --transport "$TRANSPORT" --mode "$MODE" \
    --router "tcp://$r:7100" --keys "$STATE/keys/worker" --control "tcp://$d:7201" --kv-host "$d" --kv-port 7300 ${EXTRA:-}
  start prefill prefill "${ucx[@]}" -- \
    "$BIN/pdserve-worker" --role prefill --device cpu --model "$MODEL" --transport "$TRANSPORT" --mode "$MODE" \
    --router "tcp://$r:7100" --keys "$STATE/keys/worker" --control "tcp://$p:7201" ${EXTRA:-}
  echo "waiting for both workers to register (the first start converts the model: about a minute)"
  for _ in $(seq 900); do
    if status quiet | grep -q '"status": *"ok"\|"status":"ok"'; then status; return 0; fi
    for n in router decode prefill; do
      kill -0 "$(cat "$STATE/$n.pid")" 2>/dev/null || { tail -20 "$STATE/$n.log"; die "$n exited (log: $STATE/$n.log)"; }
    done
    sleep 1
  done
  die "not ready after 900 s; logs in $STATE"
}

status() {
  local out
  out=$(curl -s -m 5 -H "Authorization: Bearer $(cat "$STATE/api-key" 2>/dev/null)" "http://${IP[router]}:8000/health" || true)
  if [ "${1:-}" = quiet ]; then echo "$out"; return; fi
  echo "$out" | python3 -m json.tool 2>/dev/null || echo "no answer from http://${IP[router]}:8000/health"
  echo "API: http://${IP[router]}:8000 (key in $STATE/api-key); logs in $STATE/*.log"
}

down() {
  need_root
  for n in prefill decode router; do  # SIGTERM: workers say goodbye, the router drains
    [ -f "$STATE/$n.pid" ] && kill "$(cat "$STATE/$n.pid")" 2>/dev/null || true
  done
  sleep 2
  for h in "${HOSTS[@]}"; do
    for pid in $(ip netns pids "pdserve-$h" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "pdserve-$h" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -f "$STATE"/*.pid
  echo "down (logs kept in $STATE)"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  shape) need_root; [ $# = 3 ] || die "usage: shape HOST RATE|off"; shape "$2" "$3" ;;
  link) need_root; [ $# = 3 ] || die "usage: link HOST up|down"
        ip link set "${VETH[$2]}" "$3" && in_ns "$2" ip link set eth0 "$3" && echo "$2 link $3" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d;s/^# \{0,1\}//'; exit 2 ;;
esac
