#!/usr/bin/env bash
# On a lent GPU host (see pack.sh): stage the pieces this call carried into /tmp (they stay
# while the machine is warm), install whatever is complete, and write /tmp/env.sh (vLLM, the
# wheels and this tree on PYTHONPATH). Safe to run in every call.
#
# vLLM 0.34 warms MiniMax-M3's MSA kernels on every CUDA start, and their modules import the
# CuTe DSL (nvidia-cutlass-dsl, ~97 MB, not packed): the engine dies at start-up with "No
# module named 'cutlass'". That warm-up is switched off in the unpacked tree; it does nothing
# for the Llama shapes the benchmarks serve.
set -euo pipefail
CARRY=${1:-.gpu-carry}
mkdir -p /tmp/vllm-parts /tmp/site
for d in part1 part2 part3; do [ -d "$CARRY/$d" ] && cp "$CARRY/$d"/* /tmp/vllm-parts/; done
for d in deps deps2 mini; do
  [ -d "$CARRY/$d" ] || continue
  [ -f /tmp/site-$d.done ] && continue
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site-$d "$CARRY/$d"/*.whl > /tmp/site-$d.log 2>&1; then
    tail -20 /tmp/site-$d.log >&2
    echo "device.sh: installing $d failed" >&2
    exit 1
  fi
  cp -r --update=none /tmp/site-$d/. /tmp/site/ 2>/dev/null || cp -rn /tmp/site-$d/. /tmp/site/
  touch /tmp/site-$d.done
  echo "installed $d"
done
if [ "$(ls /tmp/vllm-parts | wc -l)" -ge 3 ] && [ ! -f /tmp/vllm/vllm/__init__.py ]; then
  mkdir -p /tmp/vllm
  cat /tmp/vllm-parts/piece.* | xz -d -T0 | tar -x -C /tmp/vllm
  echo "vLLM unpacked"
fi
KW=/tmp/vllm/vllm/model_executor/warmup/kernel_warmup.py
if [ -f "$KW" ] && ! grep -q "kvtier: no MSA warm-up" "$KW"; then
  python3 - "$KW" <<'PY'
import sys
path = sys.argv[1]
text = open(path).read()
old = "    if current_platform.is_cuda():\n        # The MSA kernels"
if old in text:
    new = "    if False:  # kvtier: no MSA warm-up (CuTe DSL not packed)\n        # The MSA kernels"
    open(path, "w").write(text.replace(old, new, 1))
    print("vLLM's MSA warm-up switched off")
PY
fi
cat > /tmp/env.sh <<EOS
export PYTHONPATH=$PWD:/tmp/vllm:/tmp/site\${PYTHONPATH:+:\$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
EOS
