#!/usr/bin/env bash
# Create .venv (if needed) and install kvtier with its test dependencies.
# torch: the CPU build 2.13.0 (this workplace has it on disk); set KVTIER_TORCH to override,
# e.g. KVTIER_TORCH="torch" in an environment that already provides a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${KVTIER_TORCH:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
