# Sourced by bench/run_*_gpu.sh (not run alone): what every GPU script starts with, and the arms they
# compare. Knobs: PYTHON (.venv/bin/python where there is one, else python3), MODEL (qwen2.5-7b),
# DEVICES (cuda:0), KV_GB (16; a script sets its own default before sourcing this file).
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
