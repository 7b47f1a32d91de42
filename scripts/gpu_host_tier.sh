#!/usr/bin/env bash
# The host tier (issue 47) on one GPU, real vLLM engines of the 8B shape (random weights):
#
#   scripts/gpu_host_tier.sh [ttft|roundrobin|all]      (default all; run from the repo root)
#
# ttft:       a fresh instance B's TTFT on prompts a live instance A stored (2k, 8k, 32k), vs
#             B's own CPU hit and recompute; greedy tokens compared between A and B
#             (~3 min on one H200: two engine start-ups, A's and B's requests).
# roundrobin: multi-turn conversations routed round-robin between two instances, kvtier with
#             private CPU tiers vs kvtier's host tier vs vLLM's native offloading, 2k- and
#             8k-token turns on the same instances (~3-4 min: three pairs of start-ups).
# Both instances share GPU 0 (each takes half of --gpu-kv-bytes, gpu_memory_utilization 0.4).
#
# Needs /tmp/env.sh (puts vLLM and its dependencies on PYTHONPATH) and $OUT (where the
# results go: per phase vllm_remote_<phase>_host_<gpu>.json and .md; on a failure also
# logs_tail.txt, the tails of the instances' and the pool services' logs). Sizes are
# environment variables: LENGTHS, REPS, CONVERSATIONS, TURNS, FIRST_TOKENS, NEW_TOKENS (a
# list: one workload per turn size), THINK_MS, CPU_BYTES, GPUS, PYTHON.
set -euo pipefail
WHAT=${1:-all}
case "$WHAT" in ttft|roundrobin|all) ;; *) echo "usage: $0 [ttft|roundrobin|all]" >&2; exit 2 ;; esac
: "${OUT:?set OUT to the folder the results go to}"
# shellcheck disable=SC1091
[ -f /tmp/env.sh ] && . /tmp/env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
LOGS=$(mktemp -d /tmp/kvtier-host-tier-XXXXXX)
mkdir -p "$OUT"
COMMON=(--tier host --shape 8b --gpus "${GPUS:-0}" --cpu-bytes "${CPU_BYTES:-17179869184}"
        --out-dir "$OUT")

tails() {  # one file back whatever failed: the last lines of every log
  for f in "$LOGS"/*/*.log; do
    [ -f "$f" ] && { echo "=== $f"; tail -n 60 "$f"; }
  done > "$OUT/logs_tail.txt" 2>&1 || true
}
trap 'rc=$?; [ $rc -ne 0 ] && tails; exit $rc' EXIT

if [ "$WHAT" != roundrobin ]; then
  echo "== ttft $(date +%T)"
  "$PY" benchmarks/vllm_remote.py --phases ttft "${COMMON[@]}" --log-dir "$LOGS/ttft" \
    --lengths "${LENGTHS:-2048,8192,32768}" --reps "${REPS:-2}"
fi
if [ "$WHAT" != ttft ]; then
  echo "== roundrobin $(date +%T)"
  "$PY" benchmarks/vllm_remote.py --phases roundrobin "${COMMON[@]}" --log-dir "$LOGS/rr" \
    --configs private,host,native --conversations "${CONVERSATIONS:-8}" --turns "${TURNS:-4}" \
    --first-tokens "${FIRST_TOKENS:-2048}" --new-tokens "${NEW_TOKENS:-2048,8192}" \
    --think-ms "${THINK_MS:-300}"
fi
echo "== done $(date +%T)"
