"""Run in a fresh process by test_remote_engines.py: one vLLM engine with kvtier whose shared
tier is the given Redis/Valkey URL; generate the prompts once (after an optional reset of the
engine's own prefix cache), wait until kvtier settled, write results and tier counters as JSON.

Usage: remote_child.py MODEL_DIR SERVER PROMPTS_JSON OUT_JSON
SERVER is a redis:// URL (one standalone server) or comma-separated HOST:PORT Cluster nodes.
"""

from __future__ import annotations

import json
import os
import sys

for _k, _v in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_k, _v)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import engine_util as eu  # noqa: E402


def remote_tier(server: str) -> dict:
    """``tiers.remote`` for a server URL, or for Cluster start-up nodes "h:p,h:p,..."."""
    if "://" in server:
        return {"url": server, "timeout_s": 1.0}
    return {"nodes": server.split(","), "timeout_s": 1.0}


def transfer_config(server: str):
    cfg = eu.kvtier_transfer_config(cpu_blocks=64)
    extra = cfg.kv_connector_extra_config["kvtier"]
    extra["tiers"]["remote"] = remote_tier(server)
    return cfg


def main() -> int:
    model_dir, server, prompts_path, out_path = sys.argv[1:5]
    with open(prompts_path) as f:
        token_prompts = json.load(f)
    llm = eu.make_llm(model_dir, transfer_config(server))
    conn = eu.scheduler_connector(llm)
    sources: list = []  # tokens per tier of each load
    loads = eu.record_loads(conn, sources)
    results = eu.generate(llm, token_prompts)
    eu.drain(llm)
    manager = conn._sched.manager
    out = {"results": results, "hit_blocks": dict(manager.stats.hit_blocks),
           "stored_blocks": dict(manager.stats.stored_blocks),
           "pending_lookups": manager.stats.remote_pending_lookups,
           "load_blocks": [len(j.keys) for j in loads], "load_sources": sources,
           "pins": manager.pins()}
    with open(out_path, "w") as f:
        json.dump(out, f)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
