#!/usr/bin/env bash
# One pdserve worker on this machine, registering with a router on another machine.
#
#   on the router's machine (10.0.0.1), once:
#     pdserve keygen ~/pdserve-keys          # ~/pdserve-keys/router stays here, ~/pdserve-keys/worker is copied
#     scp -rp ~/pdserve-keys/worker 10.0.0.2:pdserve-keys-worker   # and to every other worker machine
#     PDSERVE_API_KEY=$(openssl rand -hex 24) pdserve router --keys ~/pdserve-keys/router --host 10.0.0.1 \
#       --port 8000 --register tcp://10.0.0.1:7100 --model smollm2-135m
#   on each GPU machine:
#     KEYS=~/pdserve-keys-worker ROLE=decode  ROUTER=tcp://10.0.0.1:7100 IP=10.0.0.2 TRANSPORT=nixl deploy/node.sh
#     KEYS=~/pdserve-keys-worker ROLE=prefill ROUTER=tcp://10.0.0.1:7100 IP=10.0.0.3 TRANSPORT=nixl deploy/node.sh
#
# KEYS is the worker key folder: the router lets in only its key, the worker obeys only the router's
# key, and prefill and decode workers authenticate each other's KV channel with it (CURVE, encrypted).
# The NIXL/UCX data plane itself is not authenticated: keep it on a network only these machines
# reach (SECURITY.md).
#
# IP is this machine's address as the others reach it: the worker binds its control endpoint
# (CONTROL_PORT, router -> worker) and, for decode, its KV receiver (KV_PORT, prefill -> decode)
# there. Open those ports, the router's --register port and its HTTP port between the machines.
# The ipc transport works on one host only; use nixl (UCX: RDMA where present, else TCP) or zmq.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${KEYS:?set KEYS=<the worker key folder from pdserve keygen (DIR/worker)>}"
: "${ROLE:?set ROLE=prefill|decode|colocated}"
: "${ROUTER:?set ROUTER=tcp://<router host>:7100}"
: "${IP:?set IP=<this machine address reachable by the router and the other workers>}"
PY=${PYTHON:-python}
exec "$PY" -m pdserve.workers.cli --role "$ROLE" --model "${MODEL:-smollm2-135m}" --device "${DEVICE:-cuda:0}" \
  --transport "${TRANSPORT:-nixl}" --mode "${MODE:-bulk}" --router "$ROUTER" --keys "$KEYS" \
  --control "tcp://$IP:${CONTROL_PORT:-7201}" --kv-host "$IP" --kv-port "${KV_PORT:-7300}" \
  --worker-id "${WORKER_ID:-$ROLE-$(hostname)-${DEVICE:-cuda:0}}" ${EXTRA:-}
