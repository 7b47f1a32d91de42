#!/usr/bin/env bash
# Pack what a lent GPU host (torch + CUDA, no package index, no vLLM) needs to serve with vLLM
# 0.34 and kvtier, in pieces that each fit one device call (64 MiB):
#
#   scripts/gpu/pack.sh [OUTDIR]          (default .gpu-carry; add it to .git/info/exclude)
#
#   OUTDIR/part1..3   vLLM 0.34.0's package tree (../shared/gpu/pack_vllm.sh)
#   OUTDIR/deps       the wheels vLLM 0.32 needs there (pack_vllm.sh's list)
#   OUTDIR/deps2      what 0.34 needs beyond them (vllm-0.34-extra-wheels.txt)
#   OUTDIR/mini       kvtier's own wheels the host lacks (kvtier-wheels.txt)
#
# Then on the device, one call per piece, each carrying that piece and scripts/gpu:
#   bash scripts/gpu/device.sh OUTDIR        (stages what the call carried; once all is there,
#                                             installs it and writes /tmp/env.sh)
# e.g. carry [part3, deps, mini], then [part1], then [part2], then [deps2] with the benchmark.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.gpu-carry}
HERE=scripts/gpu
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64)
[ -d "$OUT/part1" ] || bash ../shared/gpu/pack_vllm.sh 0.34.0 "$OUT"
for pair in "deps2:vllm-0.34-extra-wheels.txt" "mini:kvtier-wheels.txt"; do
  dir=${pair%%:*}; list=$HERE/${pair#*:}
  echo "downloading $dir ($list) ..."
  if ! python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$OUT/$dir" -r "$list" \
      > "$OUT/$dir.log" 2>&1; then
    grep -v "is ignored" "$OUT/$dir.log" | tail -20 >&2
    echo "pack.sh: downloading $dir failed" >&2
    exit 1
  fi
done
du -sh "$OUT"/part* "$OUT"/deps "$OUT"/deps2 "$OUT"/mini | sed 's/^/  /'
