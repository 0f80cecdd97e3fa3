# Sourced by bench/run_*_gpu.sh (not run alone): what every GPU script starts with, and the arms they
# compare. Knobs: PYTHON (.venv/bin/python where there is one, else python3), MODEL (qwen2.5-7b),
# DEVICES (cuda:0), KV_GB (16; a script sets its own default before sourcing this file), STEP_TRACE (1: the
# scripts that start one server per folder trace its workers' steps into FOLDER/steps; 0: not), PROFILE (an
# engine JSON of this GPU and code: the traces' steps priced by it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; fi
PYTHON=${PYTHON:-python3}

MODEL=${MODEL:-qwen2.5-7b}
DEVICES=${DEVICES:-cuda:0}
KV_GB=${KV_GB:-16}

# arm_spec ARM N: the `--arm` value of ARM (colocated, colocated-unchunked or disaggregated), the colocated
# arms with N colocated workers; anything else is refused (exit 2)
arm_spec() {
  local colocated="--prefill-workers 0 --decode-workers 0 --colocated-workers $2"
  case $1 in
    colocated) echo "colocated=colocated:$colocated" ;;
    colocated-unchunked) echo "colocated-unchunked=colocated:$colocated --worker-arg=--no-chunked-prefill" ;;
    disaggregated) echo "disaggregated=disaggregated:--no-colocated --prefill-workers 1 --decode-workers 1" ;;
    *) echo "ARM is colocated, colocated-unchunked or disaggregated, got '$1'" >&2; return 2 ;;
  esac
}

# results_of FOLDER: the path of FOLDER's load results, results.json or else results.json.gz (a large one is
# committed gzipped; every reader takes either); fails, printing nothing, where FOLDER holds neither
results_of() {
  local f
  for f in "$1/results.json" "$1/results.json.gz"; do
    if [ -f "$f" ]; then echo "$f"; return 0; fi
  done
  return 1
}
# any_results FOLDER...: whether any of the FOLDERs (a glob's matches) holds load results
any_results() {
  local d
  for d in "$@"; do if results_of "$d" > /dev/null; then return 0; fi; done
  return 1
}

STEP_TRACE=${STEP_TRACE:-1}
PROFILE=${PROFILE:-}
# trace_flag FOLDER: pdserve's flag that traces its workers' steps into FOLDER/steps (nothing with STEP_TRACE=0)
trace_flag() { if [ "$STEP_TRACE" = 1 ]; then echo "--step-trace $1/steps"; fi; }
# trace_summary FOLDER: FOLDER/steps summarised by `pdserve-bench trace` into FOLDER/steps.md and steps.json, a
# line per run of FOLDER/results.json among them, and the prompt steps priced (--prompt-cost: device time a
# prompt token, a fit of a step's cost, with PROFILE each step beside its unchunked prefill by prefix)
trace_summary() {
  if [ "$STEP_TRACE" != 1 ] || [ ! -d "$1/steps" ]; then return 0; fi
  local prof=() results
  if [ -n "$PROFILE" ]; then prof=(--profile "$PROFILE"); fi
  if results=$(results_of "$1"); then prof+=(--results "$results"); fi  # a line per run of the server
  "$PYTHON" -m pdserve.bench.cli trace "$1/steps" "${prof[@]}" --prompt-cost --out "$1/steps.json" > "$1/steps.md" \
    || echo "the step trace of $1 was not summarised (exit $?)"
}
# spy_workers FOLDER: with SPY_SECONDS set, sample every pdserve worker process's Python stacks (py-spy, 100 a
# second, waiting threads included, without pausing the process; SPY_NATIVE=1: native frames too, which
# pauses it at each sample) for SPY_SECONDS, SPY_AFTER (40) seconds after the call, into
# FOLDER/spy-<pid>.json (speedscope's format: https://www.speedscope.app), summarised in FOLDER/spy.md
# (`pdserve-bench spy`: per thread, and inside the engine's step launches); run in
# the background beside a load (`spy_workers F & ... ; wait`). Needs py-spy on PATH (a wheel in .whl/:
# `pip download py-spy --no-deps --only-binary=:all: -d .whl`) and ptrace rights over the workers (root).
# Why: a step trace says how long a launch took and whether its thread computed, waited or was preempted
# (step_trace.py); the stacks say in what.
spy_workers() {
  if [ -z "${SPY_SECONDS:-}" ]; then return 0; fi
  if ! command -v py-spy > /dev/null; then echo "SPY_SECONDS: no py-spy on PATH, no stacks sampled"; return 0; fi
  sleep "${SPY_AFTER:-40}"
  local pid pids how="--nonblocking"
  if [ "${SPY_NATIVE:-0}" = 1 ]; then how="--native"; fi  # native frames too, pausing the process at each sample
  pids=$(pgrep -f 'pdserve.workers.cli' || true)
  if [ -z "$pids" ]; then echo "SPY_SECONDS: no pdserve worker running ${SPY_AFTER:-40} s in"; return 0; fi
  mkdir -p "$1"
  for pid in $pids; do
    py-spy record --pid "$pid" $how --idle --rate 100 --duration "$SPY_SECONDS" --format speedscope \
      --output "$1/spy-$pid.json" > "$1/spy-$pid.log" 2>&1 &
  done
  wait
  compgen -G "$1/spy-*.json" > /dev/null && { "$PYTHON" -m pdserve.bench.cli spy "$1"/spy-*.json > "$1/spy.md" 2>&1 \
    || echo "the stacks in $1 were not summarised (exit $?)"; }
  return 0
}
# compress_big FOLDER: its results.json and step traces over 1 MB gzipped in place (results.json.gz, steps-*.jsonl.gz;
# every reader takes either form), so that a folder committed to bench/results stays small
compress_big() {
  local f
  while IFS= read -r -d '' f; do gzip -9 -n -f "$f"; done \
    < <(find "$1" \( -name results.json -o -name 'steps-*.jsonl' -o -name 'spy-*.json' \) -size +1M -print0 2>/dev/null)
}
