#!/usr/bin/env bash
# Set up, then run the whole test suite (GPU tests skip without CUDA; extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
