"""Run in a fresh process by test_engine.py: start vLLM with kvtier on an existing disk
directory, generate once (no warm-up run), and write the results as JSON.

The worker runs in a process of its own (``distributed_executor_backend="mp"``), so this also
proves the cross-process path: metadata pickled to the worker, worker reports aggregated back,
and the scheduler reading the disk index while the worker process holds the store open.

Usage: engine_child.py MODEL_DIR DISK_DIR PROMPTS_JSON OUT_JSON
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


def main() -> int:
    model_dir, disk_dir, prompts_path, out_path = sys.argv[1:5]
    with open(prompts_path) as f:
        token_prompts = json.load(f)
    llm = eu.make_llm(model_dir, eu.kvtier_transfer_config(cpu_blocks=64, disk_dir=disk_dir),
                      distributed_executor_backend="mp")
    manager = eu.scheduler_connector(llm)._sched.manager
    restored = manager.usage()["DISK"]["used_blocks"]
    results = eu.generate(llm, token_prompts)
    eu.drain(llm)
    out = {"results": results, "restored_disk_blocks": restored,
           "hit_blocks": dict(manager.stats.hit_blocks)}
    with open(out_path, "w") as f:
        json.dump(out, f)
    llm.llm_engine.engine_core.shutdown()  # stops the worker process (closes its disk store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
