"""Two vLLM instances sharing one Redis/Valkey tier: what the first computes, the second loads.

Each instance is its own process with its own, empty CPU tier (as two servers would be). The
first computes a prompt; kvtier stores its blocks in the CPU tier and writes them back to the
shared tier. The second starts afterwards, has never seen the prompt, and loads it from the
shared tier ("REMOTE") instead of computing it.

    valkey-server --port 6379 --bind 127.0.0.1 --save '' --dir /tmp  # or redis-server
    python examples/shared_tier.py --url redis://127.0.0.1:6379

The model is vllm_offline.py's tiny random-weight Llama (nothing is downloaded); both instances
load the same one, so their blocks have the same keys. Needs kvtier's ``remote`` extra
(``pip install 'kvtier[remote]'``). Runs on vLLM's CPU backend and on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from vllm_offline import (  # this directory is on sys.path when the script runs
    PROMPT_TOKENS,
    generate,
    kvtier_hits,
    kvtier_settings,
    make_llm,
    vllm_hits_by_source,
    write_tiny_model,
)

PROMPT = [(11 * i) % 991 + 5 for i in range(PROMPT_TOKENS)]
WHOLE_BLOCKS = PROMPT_TOKENS // 32


def wait_for_shared_copies(llm, snapshot: str, timeout_s: float = 60.0) -> int:
    """The write-back to the shared tier runs after the request finished: step the engine until
    kvtier's stats count the prompt's blocks as stored there (a process that exits earlier
    leaves them unwritten)."""
    from kvtier.runtime.snapshot import read_snapshot

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = read_snapshot(snapshot) or {}
        stored = (snap.get("manager") or {}).get("stored_blocks", {}).get("REMOTE", 0)
        if stored >= WHOLE_BLOCKS:
            return stored
        llm.llm_engine.step()
        time.sleep(0.1)
    raise RuntimeError("the prompt's blocks did not reach the shared tier in time")


def instance(name: str, model: str, url: str, work: str) -> dict:
    snapshot = os.path.join(work, f"stats-{name}.json")
    settings = kvtier_settings(snapshot, disk=None)
    settings["tiers"]["remote"] = {"url": url}
    llm = make_llm(model, settings)
    out = generate(llm, PROMPT)
    result = {"instance": name, "cached_tokens": out.num_cached_tokens or 0,
              "tokens": list(out.outputs[0].token_ids)}
    if name == "first":
        result["stored_in_shared_tier"] = wait_for_shared_copies(llm, snapshot)
    else:
        result["kvtier_hits"] = kvtier_hits(snapshot, result["cached_tokens"])
        result["vllm_sources"] = vllm_hits_by_source(llm)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the shared Redis/Valkey, redis://HOST:PORT")
    ap.add_argument("--workdir", help="where the model and the stats go (default: a temp dir)")
    ap.add_argument("--instance", choices=("first", "second"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU backend only
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    work = args.workdir or tempfile.mkdtemp(prefix="kvtier-shared-")
    model = os.path.join(work, "model")
    if args.instance:  # one instance, in a process of its own: the last stdout line is JSON
        print(json.dumps(instance(args.instance, model, args.url, work)), flush=True)
        return
    write_tiny_model(model)
    results = {}
    for name in ("first", "second"):
        proc = subprocess.run([sys.executable, __file__, "--url", args.url, "--workdir", work,
                               "--instance", name], stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"instance {name} failed (exit {proc.returncode})")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = results["first"], results["second"]
    print(f"first instance:  {first['cached_tokens']} of {PROMPT_TOKENS} prompt tokens cached; "
          f"{first['stored_in_shared_tier']} blocks written to the shared tier")
    print(f"second instance: {second['cached_tokens']} of {PROMPT_TOKENS} prompt tokens cached, "
          f"same output tokens: {first['tokens'] == second['tokens']}")
    print(f"  kvtier's tokens per tier:  {second['kvtier_hits']}")
    print(f"  vLLM's cache-hit sources:  {second['vllm_sources']}")


if __name__ == "__main__":
    main()
