#!/usr/bin/env bash
# The scheduler-level connector suite again, against vLLM 0.33 (called by scripts/test.sh).
#
# vLLM 0.33.0 cannot be installed normally here (it pins certifi >= 2026.10.19, which the
# registry lacks) and its CUDA wheel has no CPU engine, so it goes, without dependencies,
# into .venv/vllm-0.33.0 (a --target directory, ~25 s) and is put first on PYTHONPATH over
# the 0.32 test environment; its scheduler runs on CPU. The install is kept: a later run
# whose stamp matches does no pip work. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.33.0
DIR=.venv/vllm-$VERSION
STAMP=$DIR/.kvtier-stamp
say() { echo "kvtier vllm $VERSION: $*" >&2; }

if [ "${KVTIER_SETUP_FORCE:-0}" = 1 ] || [ "$(cat "$STAMP" 2>/dev/null)" != "vllm==$VERSION" ]; then
  say "installing vllm==$VERSION --no-deps into $DIR (a 336 MB download)"
  rm -rf "$DIR"
  .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off -q \
    --no-deps --target "$DIR" "vllm==$VERSION"
  echo "vllm==$VERSION" > "$STAMP"
else
  say "$DIR is up to date: nothing to install"
fi

SUITE=(
  tests/connectors/vllm/test_compat.py
  tests/connectors/vllm/test_connector_scheduler.py
  tests/connectors/vllm/test_connector_features.py
  tests/connectors/vllm/test_connector_concurrency.py
  tests/connectors/vllm/test_connector_sleep.py
  tests/connectors/vllm/test_connector_hybrid.py
  tests/connectors/vllm/test_connector_hybrid_load_failure.py
  tests/connectors/vllm/test_connector_layer_fences.py
  tests/connectors/vllm/test_connector_contract.py
)
say "scheduler-level suite against vLLM $VERSION"
PYTHONPATH="$DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}" KVTIER_EXPECT_VLLM=$VERSION \
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "${SUITE[@]}" "$@"
