#!/usr/bin/env bash
# Set up, then run the whole test suite (GPU tests skip without CUDA; extra args go to pytest).
# Without extra args, the scheduler-level connector suite then runs again against vLLM 0.33
# (scripts/test_vllm033.sh; KVTIER_SKIP_VLLM033=1 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
if [ $# -gt 0 ] || [ "${KVTIER_SKIP_VLLM033:-0}" = 1 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
.venv/bin/python -m pytest -q -p no:cacheprovider
exec bash scripts/test_vllm033.sh
