#!/usr/bin/env bash
# One pdserve worker on this machine, registering with a router on another machine.
#
#   on the router's machine (10.0.0.1):
#     pdserve router --host 0.0.0.0 --port 8000 --register tcp://0.0.0.0:7100 --model smollm2-135m
#   on each GPU machine:
#     ROLE=decode  ROUTER=tcp://10.0.0.1:7100 IP=10.0.0.2 DEVICE=cuda:0 TRANSPORT=nixl deploy/node.sh
#     ROLE=prefill ROUTER=tcp://10.0.0.1:7100 IP=10.0.0.3 DEVICE=cuda:0 TRANSPORT=nixl deploy/node.sh
#
# IP is this machine's address as the others reach it: the worker binds its control endpoint
# (CONTROL_PORT, router -> worker) and, for decode, its KV receiver (KV_PORT, prefill -> decode)
# there. Open those ports, the router's --register port and its HTTP port between the machines.
# The ipc transport works on one host only; use nixl (UCX: RDMA where present, else TCP) or zmq.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ROLE:?set ROLE=prefill|decode|colocated}"
: "${ROUTER:?set ROUTER=tcp://<router host>:7100}"
: "${IP:?set IP=<this machine address reachable by the router and the other workers>}"
PY=${PYTHON:-python}
exec "$PY" -m workers.cli --role "$ROLE" --model "${MODEL:-smollm2-135m}" --device "${DEVICE:-cuda:0}" \
  --transport "${TRANSPORT:-nixl}" --mode "${MODE:-bulk}" --router "$ROUTER" \
  --control "tcp://$IP:${CONTROL_PORT:-7201}" --kv-host "$IP" --kv-port "${KV_PORT:-7300}" \
  --worker-id "${WORKER_ID:-$ROLE-$(hostname)-${DEVICE:-cuda:0}}" ${EXTRA:-}
