#!/usr/bin/env bash
# Set up, then run the main job: `kvtier bench` on the bundled sample trace (extra args pass on).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvtier bench "$@"
