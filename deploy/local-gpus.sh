#!/usr/bin/env bash
# The router and one worker per GPU on this machine, each process started by hand (what
# `pdserve --devices cuda:0,cuda:1` does for you): useful to give each worker its own flags or logs.
#
#   deploy/local-gpus.sh                          prefill on cuda:0, decode on cuda:1
#   PREFILL=cuda:0,cuda:1 DECODE=cuda:2,cuda:3 COLOCATED=cuda:4 TRANSPORT=nixl MODE=layer deploy/local-gpus.sh
#
# The router and every worker get --parent-pid of this script: when the script ends (Ctrl-C, kill,
# even kill -9) they end too. Logs go to $LOGS/<worker>.log. The control plane is CURVE: the script
# makes a deployment's keys (`pdserve keygen`) in a private temporary folder, removed at the end, unless
# KEYS names a folder `pdserve keygen` wrote already (the router gets $KEYS/router, workers $KEYS/worker).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODEL=${MODEL:-smollm2-135m}
TRANSPORT=${TRANSPORT:-ipc}
MODE=${MODE:-bulk}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
REGISTER=${REGISTER:-tcp://127.0.0.1:7100}
PREFILL=${PREFILL:-cuda:0}
DECODE=${DECODE:-cuda:1}
COLOCATED=${COLOCATED:-}
LOGS=${LOGS:-/tmp/pdserve-logs}
EXTRA=${EXTRA:-}  # more flags for every worker, e.g. "--kv-memory-gb 20"
mkdir -p "$LOGS"
made_keys=
if [ -z "${KEYS:-}" ]; then
  KEYS=$(mktemp -d -t pdserve-keys.XXXXXX)  # 0700
  made_keys=$KEYS
  "$PY" -m pdserve.server.cli keygen "$KEYS/deployment" > /dev/null
  KEYS=$KEYS/deployment
fi

pids=()
stop() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
  if [ -n "$made_keys" ]; then rm -rf "$made_keys"; fi
}
trap stop EXIT INT TERM

"$PY" -m pdserve.server.cli router --model "$MODEL" --host "$HOST" --port "$PORT" --register "$REGISTER" \
  --keys "$KEYS/router" --parent-pid $$ > "$LOGS/router.log" 2>&1 &
pids+=($!)

start_worker() {  # role device index
  local id="$1-$3"
  # shellcheck disable=SC2086
  "$PY" -m pdserve.workers.cli --role "$1" --device "$2" --worker-id "$id" --model "$MODEL" --transport "$TRANSPORT" \
    --mode "$MODE" --router "$REGISTER" --keys "$KEYS/worker" --parent-pid $$ $EXTRA > "$LOGS/$id.log" 2>&1 &
  pids+=($!)
  echo "started $id on $2 (log $LOGS/$id.log)"
}
i=0; for dev in ${PREFILL//,/ }; do start_worker prefill "$dev" $i; i=$((i + 1)); done
i=0; for dev in ${DECODE//,/ }; do start_worker decode "$dev" $i; i=$((i + 1)); done
i=0; for dev in ${COLOCATED//,/ }; do start_worker colocated "$dev" $i; i=$((i + 1)); done

expected=$(( $(echo "$PREFILL $DECODE $COLOCATED" | tr ',' ' ' | wc -w) ))
echo "waiting for $expected workers to register at $REGISTER ..."
for _ in $(seq 1 900); do
  n=$(curl -s "http://$HOST:$PORT/health" | "$PY" -c 'import json,sys; print(len(json.load(sys.stdin)["workers"]))' 2>/dev/null || echo 0)
  if [ "$n" = "$expected" ]; then
    echo "pdserve ready: http://$HOST:$PORT ($expected workers; KV $TRANSPORT/$MODE)"
    break
  fi
  sleep 1
done
wait -n "${pids[@]}"
echo "a process exited; stopping the rest (logs in $LOGS)"
