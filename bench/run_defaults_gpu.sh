#!/usr/bin/env bash
# Is the colocated worker's default chunk budget the best one measured (within 10%), and never below the
# unchunked worker? Are a prefill and a decode worker's defaults, sharing the GPU, the best of theirs (pd-*
# arms)? One fresh pdserve per arm, a capacity search of >= 60-s probes per arm, on one workload; then
# `pdserve-bench defaults` judges the brackets, each topology against its own default: the colocated arms
# into RESULTS/<workload>/defaults.md (.json), the pd-* arms into defaults-pd.md (.json).
#
#   WORKLOAD=mixed bench/run_defaults_gpu.sh                 # every arm below, in order (~15 minutes on an H200)
#   WORKLOAD=mixed ARMS=default,unchunked,chunk16384 bench/run_defaults_gpu.sh   # some arms (one call's worth)
#   WORKLOAD=long ARMS=default,unchunked bench/run_defaults_gpu.sh
#   WORKLOAD=long MORE="unchunked:1.05,1.15 default:1.0" bench/run_defaults_gpu.sh   # more probes of measured arms
#   WORKLOAD=mixed MORE=auto bench/run_defaults_gpu.sh       # the probes the verdict names as deciding what
#                                                            # is open, judged again after each round
#                                                            # (AUTO_ROUNDS, 3; with ARMS: after those arms)
#   WORKLOAD=mixed JUDGE=1 bench/run_defaults_gpu.sh         # only the verdicts, from the arms measured so far
#                                                            # (else a call judges the kinds of arms it was given)
#   WORKLOAD=mixed ARMS=pd-default,pd-seqs128,pd-seqs32,pd-chunk2048,pd-layer bench/run_defaults_gpu.sh
#                                                            # the disaggregated arms (twice: ~2 calls)
#   WORKLOAD=mixed ARMS=pd-default,pd-pbatch1 bench/run_defaults_gpu.sh
#                                                            # the prefill worker's batch against one prompt a forward
#
# Colocated arms (one colocated worker alone on the GPU: --prefill-workers 0 --decode-workers 0
# --colocated-workers 1, KV GiB of KV pool): default (no chunk flag: the worker's own default), chunkN
# (--chunk-tokens N), attnN (--chunk-attention-tokens N: 0, a chunk of --chunk-tokens at any depth of a prompt, as
# peers count their budget), unchunked (--no-chunked-prefill), threadsN (pdserve --threads N: each worker's CPU
# threads for torch, where the default shares the machine's cores among the workers; pd-threadsN likewise for the pair).
# Disaggregated arms (one prefill and one decode worker sharing the GPU: --no-colocated --prefill-workers 1
# --decode-workers 1, PD_KV GiB of KV pool each): pd-default (the workers' own defaults: bulk transfer, 64
# seats, the chunk budget of the device, the prefill batch of --max-batched-tokens), pd-chunkN (--chunk-tokens
# N: on a prefill worker, which prefills whole prompts, it sets the longest forward run through the piecewise
# path, N + --max-num-seqs tokens; a longer one runs transformers' forward, its layers compiled), pd-seqsN
# (--max-num-seqs N: the requests a decode worker seats, reserved, receiving or running; and the prompts a
# prefill worker batches), pd-pbatchN (--max-batched-tokens N: the prompt tokens a prefill worker prefills in
# one forward of several waiting prompts; pd-pbatch1, one prompt a forward, as before batching), pd-layer
# (--mode layer: the KV moves layer by layer during the prefill).
# pd-unchunked is refused: a prefill worker prefills whole prompts whatever --no-chunked-prefill says.
# Each kind's default arm (default, pd-default) runs its search first and in full (start START_RATE, doubling
# then bisecting to PRECISION, at most MAX_PROBES). Every other arm needs only the probe that decides the
# verdict (bench/load/defaults.py): it starts at its own kind's default's capacity / (1 - WITHIN) (the
# unchunked reference at the default's capacity itself), at most OTHER_PROBES (REF_PROBES) probes; failing
# that first probe shows the default within the margin of that arm (or at least the reference). A probe stops
# once it cannot pass (bench/load/early_stop.py), so a failing one costs seconds, not minutes.
#
# Workloads: mixed: 75% of prompts uniform:256:1024, 25% uniform:4096:8192 tokens, 64 out, SLOs TTFT 2 s /
# TPOT 100 ms, KV pool 16 GiB. long: uniform:8192:32000 tokens, 64 out, TTFT 4 s / TPOT 100 ms (a 32k prefill
# alone takes ~1.1 s on an H200: a 2-s TTFT would leave no room for any queue), KV pool 40 GiB. The pd-* arms'
# pools are PD_KV GiB a worker on both (16: two workers' weights, ~15 GiB each, and two pools fit an H100's
# 80 GB; the decode worker's 16 GiB hold ~290k tokens of qwen2.5-7b, ~14 of the long workload's prompts).
# Arms already measured (RESULTS/<workload>/<arm>/results.json, or .json.gz) are kept, not rerun: a sweep spans
# several calls. MORE="arm:rate[,rate...] ..." probes arms again where their brackets left the verdict open: one
# probe per rate (a capacity search of one probe starting there), each with its own fresh server, into
# RESULTS/<workload>/<arm>.more-<rate>/ (kept, not rerun, once measured), in the order given, after ARMS
# (which MORE alone leaves empty); `defaults` merges every folder of an arm into one bracket, and names
# probes that disagree (a pass at or above a fail) instead of judging on them. Each folder is tarred into
# $OUT/defaults-<workload>.tgz as soon as it ends (a call cut short still returns what finished).
# Knobs: SPY_SECONDS, SPY_AFTER (run_gpu_common.sh: the workers' stacks sampled with py-spy during an arm), ARMS, MORE, START_RATE, PD_START_RATE (START_RATE), PRECISION (0.1), MAX_PROBES (6), OTHER_PROBES (1),
# REF_PROBES (3), WITHIN (0.10), PROBE_SECONDS (60), PROBE_MIN_REQUESTS (a probe sends PROBE_SECONDS of arrivals or
# this many requests, whichever is more: 24 on mixed, where a 60-s probe near capacity sends ~900; 120 on long,
# where it sent ~60 at c77ebb5 and the 90% line's binomial spread was 2.3 requests, so the verdict between the
# default and unchunked rested on one or two requests: `defaults` names probes within that noise), STEP_TRACE
# and PROFILE (run_gpu_common.sh: each folder's steps/ and steps.md), CALL_SECONDS (no arm or MORE probe starts
# past it; default 560), DEFAULT_BUDGET (330 s of probes for a default arm's search), ARM_MIN_SECONDS (150: the least
# an arm or a MORE probe needs), RESULTS (bench/results/defaults-gpu), WL_FLAGS (the workload's load flags
# instead), KV, PD_KV (16, or KV where KV is given and smaller), GOODPUT, MODEL, DEVICES, PYTHON.
# A CPU dry run of the script (tiny model, ~3 minutes on 2 cores; then the same line with
# MORE="default:0.5 unchunked:0.5" in place of ARMS=... adds one probe per rate, ~75 s each; with
# ARMS=default,pd-default,pd-seqs4,pd-layer it rehearses the pairs too, 109 s measured):
#   MODEL=tiny DEVICES=cpu KV=0.2 WL_FLAGS="--input-len uniform:16:64" GOODPUT="ttft:3000 tpot:500" START_RATE=2 \
#     PROBE_SECONDS=8 MAX_PROBES=2 ARMS=default,unchunked,chunk64 RESULTS=/tmp/defaults WORKLOAD=mixed \
#     bench/run_defaults_gpu.sh
source "$(dirname "$0")/run_gpu_common.sh"  # PYTHON, MODEL, DEVICES; KV_GB set below per workload
WORKLOAD=${WORKLOAD:?set WORKLOAD (mixed or long)}
case $WORKLOAD in
  mixed) WL=(--input-len uniform:256:1024 --long-fraction 0.25 --long-input-len uniform:4096:8192)
         GOODPUT=${GOODPUT:-ttft:2000 tpot:100}; START_RATE=${START_RATE:-10}; KV=${KV:-16}
         PROBE_MIN_REQUESTS=${PROBE_MIN_REQUESTS:-24} ;;
  long) WL=(--input-len uniform:8192:32000)
        GOODPUT=${GOODPUT:-ttft:4000 tpot:100}; START_RATE=${START_RATE:-0.8}; KV=${KV:-40}
        PROBE_MIN_REQUESTS=${PROBE_MIN_REQUESTS:-120} ;;
  *) echo "WORKLOAD is mixed or long, got '$WORKLOAD'"; exit 2 ;;
esac
PD_KV=${PD_KV:-$(awk -v kv="$KV" 'BEGIN { print (kv + 0 < 16 ? kv : 16) }')}  # 16, or KV where smaller
PD_START_RATE=${PD_START_RATE:-$START_RATE}
if [ -n "${WL_FLAGS:-}" ]; then read -r -a WL <<< "$WL_FLAGS"; fi  # another workload (the CPU dry run below)
MORE=${MORE:-}
AUTO_MORE=0
if [ "$MORE" = auto ]; then AUTO_MORE=1; fi  # the probes the verdict names (pdserve-bench defaults' next_probes)
AUTO_ROUNDS=${AUTO_ROUNDS:-3}
if [ -n "$MORE" ]; then ARMS=${ARMS:-}; else ARMS=${ARMS:-default,unchunked,chunk16384,chunk2048,chunk512}; fi
OUTPUT_LEN=${OUTPUT_LEN:-64}
PRECISION=${PRECISION:-0.1}
MAX_PROBES=${MAX_PROBES:-6}
OTHER_PROBES=${OTHER_PROBES:-1}
REF_PROBES=${REF_PROBES:-3}
WITHIN=${WITHIN:-0.10}
PROBE_SECONDS=${PROBE_SECONDS:-60}
CALL_SECONDS=${CALL_SECONDS:-560}
DEFAULT_BUDGET=${DEFAULT_BUDGET:-330}  # seconds of probes for the default arm's search
ARM_MIN_SECONDS=${ARM_MIN_SECONDS:-150}
RESULTS=${RESULTS:-bench/results/defaults-gpu}
DIR="$RESULTS/$WORKLOAD"
mkdir -p "$DIR"

ARM_NAMES="default, unchunked, chunkN, attnN, threadsN, pd-default, pd-chunkN, pd-seqsN, pd-pbatchN, pd-threadsN or pd-layer"
arm_flags() {  # the workers' flags of an arm, on top of its kind's (load_arm)
  case $1 in
    default|pd-default|pd-layer) echo "" ;;
    unchunked) echo "--worker-arg=--no-chunked-prefill" ;;
    chunk[0-9]*|pd-chunk[0-9]*) [[ ${1#*chunk} =~ ^[0-9]+$ ]] && echo "--worker-arg=--chunk-tokens=${1#*chunk}" ;;
    attn[0-9]*) [[ ${1#attn} =~ ^[0-9]+$ ]] && echo "--worker-arg=--chunk-attention-tokens=${1#attn}" ;;
    pd-seqs[0-9]*) [[ ${1#pd-seqs} =~ ^[0-9]+$ ]] && echo "--worker-arg=--max-num-seqs=${1#pd-seqs}" ;;
    pd-pbatch[0-9]*) [[ ${1#pd-pbatch} =~ ^[0-9]+$ ]] && echo "--worker-arg=--max-batched-tokens=${1#pd-pbatch}" ;;
    threads[0-9]*|pd-threads[0-9]*) [[ ${1#*threads} =~ ^[0-9]+$ ]] && echo "--threads ${1#*threads}" ;;
    pd-unchunked) echo "pd-unchunked measures nothing: a prefill worker prefills each prompt whole whatever" \
                       "--no-chunked-prefill says (docs/benchmarks.md); an arm is $ARM_NAMES" >&2; return 2 ;;
    *) false ;;
  esac || { echo "an arm is $ARM_NAMES (N: digits), got '$1'" >&2; return 2; }
}
is_pd() { [[ $1 == pd-* ]]; }
default_of() { if is_pd "$1"; then echo pd-default; else echo default; fi; }  # the default arm of an arm's kind
load_arm() {  # the `load --arm` value of an arm: LABEL=POLICY:FLAGS
  if is_pd "$1"; then echo "$1=disaggregated:--no-colocated --prefill-workers 1 --decode-workers 1 $(arm_flags "$1")"
  else echo "$1=colocated:--prefill-workers 0 --decode-workers 0 --colocated-workers 1 $(arm_flags "$1")"; fi
}
server_args() {  # pdserve's flags before an arm's own (the colocated arms' as the sweep at 6ff38c7 ran them)
  local mode=bulk kv=$KV
  if is_pd "$1"; then kv=$PD_KV; fi
  if [ "$1" = pd-layer ]; then mode=layer; fi
  echo "--model $MODEL --devices $DEVICES --transport ipc --mode $mode --kv-memory-gb $kv"
}
capacity_of() {  # the highest passing rate of an arm measured in DIR (empty: none); results.json or .json.gz
  "$PYTHON" -c "import sys; from pdserve.bench.load.report import read_results
c = read_results(sys.argv[1])['arms'][0]['capacity']['capacity_rate']; print(c or '')" \
    "$DIR/$1/results.json" 2>/dev/null
}
more_probes() {  # MORE ("arm:rate[,rate...] ...") as "arm rate" lines, checked before anything runs
  local spec arm rate rates specs
  if [ "$AUTO_MORE" = 1 ]; then return 0; fi  # MORE=auto: the verdict names them, after the ARMS
  read -r -a specs <<< "$MORE"
  for spec in "${specs[@]}"; do
    arm=${spec%%:*}; rates=${spec#*:}
    if [[ $spec != *:* || -z $rates ]]; then echo "MORE takes arm:rate[,rate...] entries, got '$spec'" >&2; return 2; fi
    arm_flags "$arm" > /dev/null || return 2
    IFS=, read -r -a rates <<< "$rates"
    for rate in "${rates[@]}"; do
      if [[ ! $rate =~ ^[0-9]*\.?[0-9]+$ || $rate =~ ^[0.]+$ ]]; then
        echo "MORE: a rate is a number of requests/s > 0, got '$rate' in '$spec'" >&2; return 2
      fi
      echo "$arm $rate"
    done
  done
}
judge_kind() {  # KIND (colocated or pd): its arms' folders against its own default, into NAME.md and .json
  local kind=$1 default=$2 name=$3 title=$4 from=() d
  for d in "$DIR"/*/; do
    if ! results_of "$d" > /dev/null; then continue; fi
    if is_pd "$(basename "$d")"; then [ "$kind" = pd ] || continue; else [ "$kind" = colocated ] || continue; fi
    from+=(--from "$d")
  done
  if [ ${#from[@]} -eq 0 ]; then return 0; fi
  if ! any_results "$DIR/$default"*/; then echo "no $default arm measured in $DIR yet"; return 0; fi
  local ref=()
  if [ "$kind" = colocated ] && any_results "$DIR"/unchunked*/; then ref=(--reference unchunked); fi
  "$PYTHON" -m pdserve.bench.cli defaults "${from[@]}" --default "$default" "${ref[@]}" --within "$WITHIN" \
    --title "$title" --out "$DIR" --name "$name"
}
judge() {  # KIND...: each topology against its own default, never a colocated arm against a pair
  local kind
  for kind in "$@"; do
    case $kind in
      colocated) judge_kind colocated default defaults "colocated chunk budget, $WORKLOAD workload, one GPU" ;;
      pd) judge_kind pd pd-default defaults-pd "a prefill and a decode worker sharing one GPU, $WORKLOAD workload" ;;
    esac
  done
}
kinds_of() {  # ARM...: the kinds among them (colocated, pd), each once: a call judges what it measured
  local arm colocated="" pd=""
  for arm in "$@"; do if is_pd "$arm"; then pd=pd; else colocated=colocated; fi; done
  echo $colocated $pd
}
MORE_PROBES=()
more=$(more_probes) || exit 2
if [ -n "$more" ]; then mapfile -t MORE_PROBES <<< "$more"; fi
IFS=, read -r -a ARM_LIST <<< "$ARMS"
for arm in "${ARM_LIST[@]}"; do arm_flags "$arm" > /dev/null || exit 2; done  # every arm checked before any runs
if [ "${JUDGE:-0}" = 1 ]; then judge colocated pd; exit 0; fi

run_load() {  # ARM START PROBES BUDGET FOLDER: a fresh server for ARM, a capacity search from START into FOLDER
  local spec; spec=$(load_arm "$1")
  mkdir -p "$5"
  "$PYTHON" -m pdserve.bench.load.host_cpu snapshot "$5/host-cpu.txt" before || true  # throttling, steal, load
  spy_workers "$5" &  # SPY_SECONDS: the workers' stacks, sampled during the probes (run_gpu_common.sh)
  # shellcheck disable=SC2086  # GOODPUT holds several words on purpose
  "$PYTHON" -m pdserve.bench.cli load --arm "$spec" --server-args "$(server_args "$1") $(trace_flag "$5")" \
    --server-timeout 300 --capacity-search --goodput $GOODPUT --search-start-rate "$2" \
    --search-max-probes "$3" --search-precision "$PRECISION" --probe-seconds "$PROBE_SECONDS" \
    --probe-min-requests "$PROBE_MIN_REQUESTS" --arm-budget "$4" --sweep-factors '' \
    "${WL[@]}" --output-len "$OUTPUT_LEN" --tokenizer "$MODEL" --warmup-batch 4 --warmup-max-batches 6 \
    --request-timeout 300 --out "$5" --no-progress --no-plots || echo "arm $1: load exited $?"
  wait  # the stacks' sampling, if any
  "$PYTHON" -m pdserve.bench.load.host_cpu snapshot "$5/host-cpu.txt" after || true
  "$PYTHON" -m pdserve.bench.load.host_cpu summary "$5/host-cpu.txt" > "$5/host-cpu.md" || true
  trace_summary "$5"
  compress_big "$5"
  if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then tar czf "$OUT/defaults-$WORKLOAD.tgz" -C "$RESULTS" "$WORKLOAD"; fi
}

T0=$SECONDS
for arm in "${ARM_LIST[@]}"; do
  if results_of "$DIR/$arm" > /dev/null; then echo "arm $arm: measured already ($DIR/$arm), kept"; continue; fi
  if (( SECONDS - T0 + ARM_MIN_SECONDS > CALL_SECONDS )); then
    echo "arm $arm: not started, $((SECONDS - T0)) s of CALL_SECONDS $CALL_SECONDS gone"; continue
  fi
  default=$(default_of "$arm")
  if [ "$arm" = "$default" ]; then
    start=$START_RATE; probes=$MAX_PROBES; budget=$((CALL_SECONDS - (SECONDS - T0) - 90))
    if is_pd "$arm"; then start=$PD_START_RATE; fi
    budget=$(( budget < DEFAULT_BUDGET ? budget : DEFAULT_BUDGET ))
  else
    cap=$(capacity_of "$default" || true)
    if [ -z "$cap" ]; then echo "arm $arm: the $default arm has no capacity yet (measure it first)"; continue; fi
    if [ "$arm" = unchunked ]; then
      start=$cap; probes=$REF_PROBES
    else  # just under cap / (1 - WITHIN), so a fail there decides the margin despite rounding
      start=$("$PYTHON" -c "print($cap / (1 - $WITHIN) * 0.999)"); probes=$OTHER_PROBES
    fi
    budget=$((CALL_SECONDS - (SECONDS - T0) - 90))
  fi
  echo "arm $arm: start $start req/s, at most $probes probes, budget $budget s"
  run_load "$arm" "$start" "$probes" "$budget" "$DIR/$arm"
done
probe_more() {  # ARM RATE: one probe into DIR/ARM.more-RATE; fails where measured already or out of time
  local arm=$1 rate=$2 folder="$DIR/$1.more-$2"
  if results_of "$folder" > /dev/null; then echo "arm $arm: probed at $rate already ($folder), kept"; return 1; fi
  if (( SECONDS - T0 + ARM_MIN_SECONDS > CALL_SECONDS )); then
    echo "arm $arm: probe at $rate not started, $((SECONDS - T0)) s of CALL_SECONDS $CALL_SECONDS gone"; return 1
  fi
  echo "arm $arm: one more probe at $rate req/s into $folder"
  run_load "$arm" "$rate" 1 "$((CALL_SECONDS - (SECONDS - T0) - 90))" "$folder"
}
for probe in "${MORE_PROBES[@]}"; do
  read -r arm rate <<< "$probe"
  probe_more "$arm" "$rate" || true
done
suggested() {  # the probes the last verdicts name as deciding what is open, "arm rate" a line
  "$PYTHON" -c "import json, sys, pathlib
for f in sys.argv[1:]:
    if pathlib.Path(f).is_file():
        for p in json.loads(pathlib.Path(f).read_text())['verdict'].get('next_probes') or []:
            print(p['arm'], format(p['rate'], 'g'))" "$DIR/defaults.json" "$DIR/defaults-pd.json"
}
if [ "$AUTO_MORE" = 1 ]; then  # judge, probe what the verdict names, judge again: AUTO_ROUNDS at most
  for _ in $(seq "$AUTO_ROUNDS"); do
    judge colocated pd > /dev/null
    mapfile -t NEXT < <(suggested)
    if [ ${#NEXT[@]} -eq 0 ]; then echo "MORE=auto: no probe left that would decide a verdict"; break; fi
    ran=0
    for probe in "${NEXT[@]}"; do
      read -r arm rate <<< "$probe"
      if probe_more "$arm" "$rate"; then ran=1; fi
    done
    if [ $ran = 0 ]; then echo "MORE=auto: none of the probes named ran (measured already, or no time left)"; break; fi
  done
fi
MORE_ARMS=()
for probe in "${MORE_PROBES[@]}"; do MORE_ARMS+=("${probe%% *}"); done
if [ "$AUTO_MORE" = 1 ]; then judge colocated pd; else
  # shellcheck disable=SC2046  # the kinds are words on purpose
  judge $(kinds_of "${ARM_LIST[@]}" "${MORE_ARMS[@]}")
fi
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then tar czf "$OUT/defaults-$WORKLOAD.tgz" -C "$RESULTS" "$WORKLOAD"; fi
