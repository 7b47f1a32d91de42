"""One vLLM instance of ``vllm_remote.py``: a real ``LLM`` engine that runs the prompts it is sent.

Commands arrive as JSON lines on stdin; each answer is one stdout line starting with ``@@kv``
(vLLM's own logging shares stdout). Commands: ``gen`` (prompt tokens, max_tokens: answers the
wall milliseconds to the last token, the cached prompt tokens and the tokens), ``reset`` (drop
vLLM's GPU prefix cache, so a hit can only come from the connector), ``settle`` (let queued
stores finish), ``stats`` (kvtier's stats snapshot), ``quit``.

Connectors: ``kvtier`` (a private CPU tier), ``kvtier_remote`` (plus the shared tier,
``--remote``), ``kvtier_host`` (the CPU tier is this instance's region of the host's pool,
``--host``), ``native`` (vLLM's ``OffloadingConnector``), ``none``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_e2e_engine import connector_json, write_model  # noqa: E402

TAG = "@@kv "


def transfer_dict(connector: str, cpu_bytes: int, block_size: int, snapshot: str, *,
                  remote: dict | None = None, host: dict | None = None,
                  engine_id: str | None = None) -> dict | None:
    """``--kv-transfer-config`` of one instance as JSON. ``engine_id``: vLLM's engine id (None:
    vLLM draws a uuid); the host tier names an instance's region by it, so two instances
    sharing a pool must differ in it, as vLLM's own ids do."""
    if connector == "none":
        return None
    name = "native" if connector == "native" else "kvtier"
    tiers = {"cpu": {"capacity": cpu_bytes}}
    if connector == "kvtier_remote":
        tiers["remote"] = dict(remote or {})
    if connector == "kvtier_host":
        if not host:
            raise ValueError("kvtier_host needs the tiers.host section (--host)")
        tiers["host"] = dict(host)
    section = {"stats": {"snapshot_path": snapshot, "interval_s": 0.2}}
    out = connector_json(name, cpu_bytes, block_size, tiers=tiers, kvtier=section)
    if engine_id:
        out["engine_id"] = engine_id
    return out


def kv_transfer(a):
    from vllm.config import KVTransferConfig

    d = transfer_dict(a.connector, a.cpu_bytes, a.block_size, a.snapshot,
                      remote=json.loads(a.remote), host=json.loads(a.host),
                      engine_id=a.engine_id)
    return None if d is None else KVTransferConfig(**d)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connector",
                    choices=["none", "kvtier", "kvtier_remote", "kvtier_host", "native"])
    ap.add_argument("--remote", default="{}", help="kvtier's tiers.remote section as JSON")
    ap.add_argument("--host", default="{}", help="kvtier's tiers.host section as JSON")
    ap.add_argument("--engine-id", default=None, help="vLLM's engine id (default: a uuid)")
    ap.add_argument("--gpu-util", type=float, default=None,
                    help="gpu_memory_utilization: with kv_cache_memory_bytes set, only vLLM's "
                         "start-up check of free GPU memory reads it (default: vLLM's)")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--max-len", type=int, default=40000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cpu-bytes", type=int, default=16 << 30)
    ap.add_argument("--gpu-kv-bytes", type=int, default=24 << 30)
    ap.add_argument("--snapshot", default="/tmp/kvtier-remote-snapshot.json")
    return ap


def main() -> None:
    a = parser().parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    write_model(a.model_dir, a.shape, a.max_len)
    t0 = time.perf_counter()
    more = {} if a.gpu_util is None else {"gpu_memory_utilization": a.gpu_util}
    llm = LLM(model=a.model_dir, load_format="dummy", skip_tokenizer_init=True,
              block_size=a.block_size, max_model_len=a.max_len, seed=0, dtype="bfloat16",
              enable_prefix_caching=True, kv_transfer_config=kv_transfer(a),
              kv_cache_memory_bytes=a.gpu_kv_bytes, max_num_seqs=8, **more)
    print(TAG + json.dumps({"ready": True, "start_s": round(time.perf_counter() - t0, 2)}),
          flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "gen":
            params = SamplingParams(max_tokens=cmd.get("max_tokens", 1), temperature=0.0,
                                    ignore_eos=True)
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], params,
                               use_tqdm=False)[0]
            ms = (time.perf_counter() - t) * 1e3
            reply = {"ms": round(ms, 3), "cached": int(out.num_cached_tokens or 0),
                     "tokens": list(out.outputs[0].token_ids)}
        elif op == "reset":
            for _ in range(200):
                if llm.reset_prefix_cache():
                    break
                time.sleep(0.05)
            reply = {"ok": True}
        elif op == "settle":
            time.sleep(cmd.get("seconds", 0.5))
            llm.generate([TokensPrompt(prompt_token_ids=[11, 12, 13])],
                         SamplingParams(max_tokens=1), use_tqdm=False)
            time.sleep(cmd.get("seconds", 0.5))
            reply = {"ok": True}
        elif op == "stats":
            try:
                with open(a.snapshot) as f:
                    reply = json.load(f)
            except (OSError, ValueError) as exc:
                reply = {"error": str(exc)}
        else:
            print(TAG + json.dumps({"bye": True}), flush=True)
            break
        print(TAG + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
