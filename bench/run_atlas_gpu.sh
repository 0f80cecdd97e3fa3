#!/usr/bin/env bash
# The crossover atlas on GPUs, one (profile, arm) piece per call so that each call stays under ten
# minutes, then one call that merges the pieces into atlas.json and atlas.png (pdserve-bench atlas --from).
# Every run lasts >= RUN_SECONDS (60) of Poisson arrivals; every arm gets its own fresh pdserve, the same
# seeded prompt lengths and arrival schedule; the SLO pairs (tight: TTFT 2 s, TPOT 25 ms; loose: TTFT 2 s, TPOT
# 100 ms; quick: TTFT 500 ms, TPOT 100 ms; smooth: TTFT 2 s, no gap over 100 ms) are judged on the same runs,
# at the merge.
#
#   PROFILE=short ARM=colocated bench/run_atlas_gpu.sh      # one piece: ~30 s start + rates x ~65 s
#   PROFILE=short ARM=disaggregated bench/run_atlas_gpu.sh
#   ... (long, mixed)
#   PROFILE=short,mixed ARM=disaggregated bench/run_atlas_gpu.sh   # several pieces, one after the other
#   MERGE=1 bench/run_atlas_gpu.sh                          # atlas.json + atlas.png from every piece in OUT
#   OUT=/tmp/atlas TAR=$OUT/atlas-long.tgz PROFILE=long ARM=colocated bench/run_atlas_gpu.sh
#                                         # on the device machine: OUT tarred into TAR after the piece (the device
#                                         # returned no file of pieces/<arm>/<profile>/ written under $OUT itself)
#
# one GPU (DEVICES=cuda:0, the default): colocated = one colocated worker alone; disaggregated = a
# prefill and a decode worker sharing the GPU. Two (DEVICES=cuda:0,cuda:1): two colocated workers;
# prefill on one, decode on the other. ARM=colocated-unchunked: the colocated arm with
# --no-chunked-prefill. Knobs: MODEL (qwen2.5-7b), DEVICES, KV_GB (16), OUTPUT_LEN (64), RUN_SECONDS (60),
# MIN_REQUESTS (24), RATES (per profile below: three rates at and below the planner's one-GPU predictions
# from the engine profile of 4acfb30, which were short 66-79, long 3.0-5.1, mixed 8.1-15 req/s; a
# prediction missed a CPU measurement by +187%, so the grid reaches below; move it when a cell's bracket
# says the grid ran out; the mixed grid spans 5-15 since the colocated default measured [15, 16.2) req/s on one
# H100 (bench/results/defaults-h100-c77ebb5) and a prefill and a decode worker sharing one H200 [7.5, 8.44)
# (defaults-gpu-b051920)), TRANSPORT (ipc),
# SERVER_EXTRA, PYTHON, OUT (bench/results/atlas-gpu).
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")  # (the common part changes the directory)
source "$(dirname "$0")/run_gpu_common.sh"  # PYTHON, MODEL, DEVICES, KV_GB; arm_spec
TRANSPORT=${TRANSPORT:-ipc}
OUTPUT_LEN=${OUTPUT_LEN:-64}
RUN_SECONDS=${RUN_SECONDS:-60}
MIN_REQUESTS=${MIN_REQUESTS:-24}
SERVER_EXTRA=${SERVER_EXTRA:-}
OUT=${OUT:-bench/results/atlas-gpu}

if [ "${MERGE:-0}" = 1 ]; then
  FROM=()
  for d in "$OUT"/pieces/*/; do FROM+=(--from "$d"); done
  if [ ${#FROM[@]} -eq 0 ]; then echo "no pieces under $OUT/pieces: run PROFILE=... ARM=... first"; exit 2; fi
  exec "$PYTHON" -m pdserve.bench.cli atlas "${FROM[@]}" --out "$OUT"
fi

PROFILE=${PROFILE:?set PROFILE (short, long or mixed) and ARM (colocated, disaggregated, colocated-unchunked)}
ARM=${ARM:?set ARM (colocated, disaggregated or colocated-unchunked)}
if [[ $PROFILE == *,* || $ARM == *,* ]]; then  # several pieces, one after the other (TAR after each)
  [[ -z "${RATES:-}" || $PROFILE != *,* ]] || { echo "RATES is per profile: give one PROFILE with it"; exit 2; }
  rc=0
  for p in ${PROFILE//,/ }; do
    for a in ${ARM//,/ }; do PROFILE=$p ARM=$a "$SELF" || rc=1; done
  done
  exit $rc
fi
case $PROFILE in
  short) RATES=${RATES:-16,32,64} ;;
  long) RATES=${RATES:-1.5,3,4.5} ;;
  mixed) RATES=${RATES:-5,10,15} ;;
  *) echo "PROFILE is short, long or mixed, got '$PROFILE'"; exit 2 ;;
esac
IFS=, read -r -a DEVICE_LIST <<< "$DEVICES"
SPEC=$(arm_spec "$ARM" "${#DEVICE_LIST[@]}")

"$PYTHON" -m pdserve.bench.cli atlas --arm "$SPEC" --profiles "$PROFILE" --rates "$RATES" \
  --server-args "--model $MODEL --devices $DEVICES --transport $TRANSPORT --kv-memory-gb $KV_GB $SERVER_EXTRA" \
  --tokenizer "$MODEL" --output-len "$OUTPUT_LEN" --run-seconds "$RUN_SECONDS" --min-requests "$MIN_REQUESTS" \
  --out "$OUT/pieces/$ARM"
echo "piece in $OUT/pieces/$ARM/$PROFILE; MERGE=1 $0 builds the atlas"
if [ -n "${TAR:-}" ] && [ -d "$OUT" ]; then tar czf "$TAR" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "$OUT tarred into $TAR"; fi
