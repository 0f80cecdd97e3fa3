#!/usr/bin/env bash
# The planner's predictions beside measured capacities on one GPU, one arm per call (each under ten
# minutes), then one call that predicts and compares (pdserve-bench plan --measured).
#
#   ARM=colocated bench/run_plan_check_gpu.sh              # capacity search, >= 60-s probes (~7 minutes)
#   ARM=disaggregated bench/run_plan_check_gpu.sh          # prefill + decode sharing the GPU
#   ARM=colocated-unchunked bench/run_plan_check_gpu.sh
#   COMPARE=1 bench/run_plan_check_gpu.sh                  # plan.json: predicted vs measured, the error of each;
#                                                          # sharing.json: the disaggregated arm's slowdowns
#                                                          # (decode beside a forward, prefill beside decoding)
#                                                          # read from its per-request records, and its runs
#                                                          # replayed (bench/load/plan_shared.py)
#
# Workload (both sides): prompts INPUT_LEN (uniform:256:1024), LONG_FRACTION (0.25) of them LONG_LEN
# (uniform:4096:8192), OUTPUT_LEN (64) out; SLOs GOODPUT (ttft:2000 tpot:100). The profile: PROFILE_JSON
# (the engine JSON of the code measured: run `pdserve-bench engine` at the same commit first). Knobs:
# MODEL (qwen2.5-7b), DEVICES (cuda:0), KV_GB (16), START_RATE (4), PROBE_SECONDS (60), MIN_REQUESTS (24),
# MAX_PROBES (5),
# ARM_BUDGET (480 s), PYTHON, OUT (bench/results/plan-check-gpu).
source "$(dirname "$0")/run_gpu_common.sh"  # PYTHON, MODEL, DEVICES, KV_GB; arm_spec
INPUT_LEN=${INPUT_LEN:-uniform:256:1024}
LONG_FRACTION=${LONG_FRACTION:-0.25}
LONG_LEN=${LONG_LEN:-uniform:4096:8192}
OUTPUT_LEN=${OUTPUT_LEN:-64}
GOODPUT=${GOODPUT:-ttft:2000 tpot:100}
START_RATE=${START_RATE:-4}
PROBE_SECONDS=${PROBE_SECONDS:-60}
MIN_REQUESTS=${MIN_REQUESTS:-24}
MAX_PROBES=${MAX_PROBES:-5}
ARM_BUDGET=${ARM_BUDGET:-480}
PROFILE_JSON=${PROFILE_JSON:-bench/results/engine-nvidia-h200-2026-12-01-4acfb30.json}
OUT=${OUT:-bench/results/plan-check-gpu}
WORKLOAD=(--input-len "$INPUT_LEN" --long-fraction "$LONG_FRACTION" --long-input-len "$LONG_LEN"
          --output-len "$OUTPUT_LEN")

if [ "${COMPARE:-0}" = 1 ]; then
  MEASURED=()
  declare -A SPLIT=([colocated]="colocated x1 chunk 8192" [colocated-unchunked]="colocated x1 unchunked"
                    [disaggregated]="1P:1D sharing 1 GPU")
  for arm in colocated colocated-unchunked disaggregated; do
    if results=$(results_of "$OUT/$arm"); then MEASURED+=(--measured "${SPLIT[$arm]}=$results:$arm"); fi
  done
  if [ ${#MEASURED[@]} -eq 0 ]; then echo "no measured arm under $OUT: run ARM=... first"; exit 2; fi
  if results=$(results_of "$OUT/disaggregated"); then
    # what the planner's shared GPU assumes (Split.shared_*), read from this GPU and this code: if it differs,
    # plan with --shared-slowdowns DECODE,PREFILL,EXTRA_MS from it
    "$PYTHON" -m pdserve.bench.load.plan_shared "$results" --profile "$PROFILE_JSON" \
      --out "$OUT/sharing.json" || echo "sharing: not read (above); the plan goes on"
  fi
  # shellcheck disable=SC2086  # GOODPUT holds several words on purpose
  exec "$PYTHON" -m pdserve.bench.cli plan --profile "$PROFILE_JSON" --gpus 1 "${WORKLOAD[@]}" --goodput $GOODPUT \
    --probe-seconds "$PROBE_SECONDS" "${MEASURED[@]}" --out "$OUT/plan.json"
fi

ARM=${ARM:?set ARM (colocated, colocated-unchunked or disaggregated), or COMPARE=1}
SPEC=$(arm_spec "$ARM" 1)
# shellcheck disable=SC2086
"$PYTHON" -m pdserve.bench.cli load --arm "$SPEC" \
  --server-args "--model $MODEL --devices $DEVICES --kv-memory-gb $KV_GB $(trace_flag "$OUT/$ARM")" \
  --capacity-search --goodput $GOODPUT --search-start-rate "$START_RATE" --search-precision 0.15 \
  --search-max-probes "$MAX_PROBES" --probe-seconds "$PROBE_SECONDS" \
  --probe-min-requests "$MIN_REQUESTS" --arm-budget "$ARM_BUDGET" \
  --sweep-factors '' "${WORKLOAD[@]}" --tokenizer "$MODEL" --warmup-batch 4 --warmup-max-batches 4 \
  --request-timeout 600 --out "$OUT/$ARM" --no-progress
PROFILE=${PROFILE:-${PROFILE_JSON:-}} trace_summary "$OUT/$ARM"
compress_big "$OUT/$ARM"
echo "measured in $OUT/$ARM; COMPARE=1 $0 sets it beside the prediction"
