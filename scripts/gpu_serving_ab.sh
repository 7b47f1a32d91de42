#!/usr/bin/env bash
# kvtier vs vLLM's native offloading under load (issue 46, the saturated regime), on one GPU:
#
#   scripts/gpu_serving_ab.sh [native|kvtier|variants|all]     (default all; from the repo root)
#
# native:   vLLM's OffloadingConnector and kvtier's CPU tier (the same bytes) behind `vllm
#           serve`, 1B shape, multi-turn chat at RATES (default 16,30 req/s: under and past
#           saturation), every server marking vLLM's step phases (--vllm-marks); then the
#           phases side by side (diagnostics/step_phases.py, phases_<label>.md).
# kvtier:   the same for kvtier_cpu alone (a rerun beside an earlier native).
# variants: kvtier_cpu once per VARIANTS entry ("name=<serving.py arguments>;name2=..."), each
#           under its own label (LABEL-name), e.g.
#           VARIANTS='dma=--kvtier-json {"tiers":{"cpu":{"store_copy":"dma"}}};sync0=--sync-budget 0'
#           or the store cadence and Python's own GIL switch interval:
#           VARIANTS='every1=--store-every-steps 1;gil5=--kvtier-json {"gil_switch_interval_ms":0}'
#           or kvtier storing decoded blocks too (by default it stores prompt blocks only,
#           as native does on vLLM 0.34): VARIANTS='answers=--store-answers'
#           (arguments split at spaces: JSON without spaces).
# With BEFORE=<folder of another kvtier tree> that tree's kvtier_cpu runs too (LABEL-before),
# from its own benchmarks/serving.py: an A/B of two commits in one lease.
#
# Needs /tmp/env.sh (vLLM on PYTHONPATH: scripts/gpu/device.sh) and $OUT. ~2.5 min per server
# on an H100.
set -uo pipefail
WHAT=${1:-all}
case "$WHAT" in native|kvtier|variants|all) ;; *) echo "usage: $0 [native|kvtier|variants|all]" >&2; exit 2 ;; esac
: "${OUT:?set OUT to the folder the results go to}"
# shellcheck disable=SC1091
[ -f /tmp/env.sh ] && . /tmp/env.sh
PY=${PYTHON:-python3}
LABEL=${LABEL:-1b-saturation}
TL=${TIMELINE:-/tmp/kvtier-serving-timeline}
COMMON=(--shape 1b --rates "${RATES:-16,30}" --duration-s "${DURATION_S:-10}" --drain-s 3
        --vllm-marks --out-dir "$OUT")
mkdir -p "$OUT" "$TL"
phases() {  # $1: label, then timeline files
  local label=$1; shift
  # the last rate (past saturation): the server stops right after its window and drain
  "$PY" benchmarks/diagnostics/step_phases.py "$@" --last "${LAST_S:-14}" \
    --md "$OUT/phases_$label.md" | head -60
}
run() {  # $1: label, $2: connectors, then extra serving.py arguments
  local label=$1 conns=$2; shift 2
  echo "== $label: $conns $(date +%T)"
  "$PY" benchmarks/serving.py "${COMMON[@]}" --label "$label" --connectors "$conns" \
    --timeline "$TL/$label" "$@" 2>&1 | grep -E "^\[serving\]|Error|error" | tail -20
}
if [ "$WHAT" = native ] || [ "$WHAT" = all ]; then
  run "$LABEL" native,kvtier_cpu
  phases "$LABEL" "$TL/$LABEL"/1b-native-timeline.jsonl "$TL/$LABEL"/1b-kvtier_cpu-timeline.jsonl
elif [ "$WHAT" = kvtier ]; then
  run "$LABEL" kvtier_cpu
  phases "$LABEL" "$TL/$LABEL"/1b-kvtier_cpu-timeline.jsonl
fi
if [ "$WHAT" = variants ] || [ "$WHAT" = all ]; then
  IFS=';' read -r -a specs <<< "${VARIANTS:-}"
  for spec in "${specs[@]}"; do
    [ -n "$spec" ] || continue
    name=${spec%%=*}
    read -r -a extra <<< "${spec#*=}"
    run "$LABEL-$name" kvtier_cpu "${extra[@]}"
    phases "$LABEL-$name" "$TL/$LABEL-$name"/1b-kvtier_cpu-timeline.jsonl
  done
  if [ -n "${BEFORE:-}" ]; then
    echo "== $LABEL-before ($BEFORE) $(date +%T)"
    (cd "$BEFORE" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/serving.py \
      "${COMMON[@]}" --label "$LABEL-before" --connectors kvtier_cpu \
      --timeline "$TL/$LABEL-before" 2>&1 | grep -E "^\[serving\]|Error|error" | tail -20)
    phases "$LABEL-before" "$TL/$LABEL-before"/1b-kvtier_cpu-timeline.jsonl
  fi
fi
# the servers' logs stay here (what comes back from $OUT is a few files): their last lines
for f in "$OUT"/server-*.log; do
  [ -f "$f" ] || continue
  echo "=== $f"; grep -E "Error|error|Traceback" "$f" | tail -5
  mkdir -p /tmp/kvtier-serving-logs && mv "$f" /tmp/kvtier-serving-logs/
done
