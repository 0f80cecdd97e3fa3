#!/usr/bin/env bash
# Colocated vs disaggregated under the same load, on one GPU, with qwen2.5-7b (random weights,
# the exact Qwen2.5-7B shape): pdserve starts a colocated worker and a prefill + decode pair, all
# three on cuda:0 (KV moves over CUDA IPC), and `pdserve-bench load` sends a mix of long (8k-16k
# tokens) and short (256-2k) prompts, request i with policy i mod 2, at a sweep of Poisson rates.
#
#   bench/run_load_gpu.sh                       # defaults below; about 6-9 minutes on one H200
#   RATES=1,2,3 NUM_PROMPTS=20 bench/run_load_gpu.sh
#   MODE=layer OUT=bench/results/load-gpu-layer bench/run_load_gpu.sh
#   SMOKE=1 bench/run_load_gpu.sh               # 4 prompts at one rate: checks the setup in ~2 min
#
# Knobs (environment): RATES (req/s, both policies together), NUM_PROMPTS (per policy and rate),
# LONG_FRACTION, SHORT_LEN, LONG_LEN, OUTPUT_LEN, TRANSPORT (ipc|nixl|zmq), MODE (bulk|layer),
# KV_GB (KV pool per worker, GiB; three workers share the GPU with 15 GiB of weights each), PORT,
# GOODPUT (SLOs), DEVICE, OUT, MODEL. Results: $OUT/results.json, summary.md, *.png, server.log, gpu.txt.
# A CPU dry run of the script itself (about a minute):
#   MODEL=tiny DEVICE=cpu KV_GB=0.2 SHORT_LEN=uniform:16:64 LONG_LEN=uniform:200:400 OUTPUT_LEN=4 SMOKE=1 \
#     bench/run_load_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi

MODEL=${MODEL:-qwen2.5-7b}
PORT=${PORT:-8000}
DEVICE=${DEVICE:-cuda:0}
TRANSPORT=${TRANSPORT:-ipc}
MODE=${MODE:-bulk}
KV_GB=${KV_GB:-16}
RATES=${RATES:-0.5,1,2}
NUM_PROMPTS=${NUM_PROMPTS:-24}
LONG_FRACTION=${LONG_FRACTION:-0.25}
SHORT_LEN=${SHORT_LEN:-uniform:256:2048}
LONG_LEN=${LONG_LEN:-uniform:8192:16384}
OUTPUT_LEN=${OUTPUT_LEN:-128}
GOODPUT=${GOODPUT:-ttft:3000 tpot:100}
if [ "${SMOKE:-0}" = 1 ]; then RATES=${SMOKE_RATE:-1}; NUM_PROMPTS=4; fi
OUT=${OUT:-bench/results/load-gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"

nvidia-smi > "$OUT/gpu.txt" 2>&1 || echo "nvidia-smi not available" > "$OUT/gpu.txt"

# `python -m server.cli` is `pdserve` (works without the console script on PATH)
python -m server.cli --model "$MODEL" --port "$PORT" --devices "$DEVICE" --transport "$TRANSPORT" --mode "$MODE" \
  --kv-memory-gb "$KV_GB" > "$OUT/server.log" 2>&1 &
SERVER_PID=$!
stop_server() {
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID" || true
  fi
}
trap stop_server EXIT

echo "waiting for pdserve (log: $OUT/server.log)"
for _ in $(seq 1 600); do
  if grep -q "pdserve ready" "$OUT/server.log"; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "pdserve exited before it was ready:"; tail -50 "$OUT/server.log"; exit 1
  fi
  sleep 1
done
grep "pdserve ready" "$OUT/server.log" || { echo "pdserve not ready after 600 s"; tail -50 "$OUT/server.log"; exit 1; }

# shellcheck disable=SC2086  # GOODPUT holds several words on purpose
python -m bench.load --base-url "http://127.0.0.1:$PORT" --policies colocated,disaggregated \
  --request-rates "$RATES" --num-prompts "$NUM_PROMPTS" \
  --input-len "$SHORT_LEN" --long-fraction "$LONG_FRACTION" --long-input-len "$LONG_LEN" \
  --output-len "$OUTPUT_LEN" --tokenizer "$MODEL" --num-warmups 2 --request-timeout 900 \
  --goodput $GOODPUT --out "$OUT" --no-progress
echo "results in $OUT"
