"""The trace replay of ``vllm_e2e_child``: a window of a Mooncake-format trace sent at its
(compressed) arrival times into a real engine, with TTFT, requests/s and hit tokens per tier.

Why a window: the bundled trace reuses 512-token chunks mostly in its tail and far apart
(hundreds of thousands of tokens), so its first requests exercise no cache at all.
"""

from __future__ import annotations

import json
import time

from vllm_e2e_engine import sampling, settle, tokens


def metric_totals(llm) -> dict:
    totals: dict = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:prefix_cache_hits", "vllm:external_prefix_cache_hits",
                      "vllm:prompt_tokens") and hasattr(m, "value"):
            totals[m.name] = totals.get(m.name, 0) + m.value
    return totals


def trace_prompts(a) -> list[dict]:
    chunk: dict[int, list[int]] = {}
    rows = []
    t0 = None  # a slice of a trace starts at its own first request
    with open(a.trace) as f:
        for i, line in enumerate(f):
            if i < a.trace_offset:
                continue
            if len(rows) >= a.trace_requests:
                break
            r = json.loads(line)
            ids = r["hash_ids"][: a.trace_chunks]
            for h in ids:
                if h not in chunk:
                    chunk[h] = tokens(512, 1_000_000 + h, a.vocab)
            n = min(int(r["input_length"]), 512 * len(ids), a.max_len - 64)
            p = [t for h in ids for t in chunk[h]][:n]
            t0 = r["timestamp"] if t0 is None else t0
            rows.append({"t": (r["timestamp"] - t0) / 1e3 / a.trace_speedup, "prompt": p,
                         "out": max(1, min(int(r["output_length"]), a.trace_max_out))})
    return rows


def manager_counts(a) -> dict:
    """kvtier's hit / store / eviction counters per tier from its stats snapshot ({} when
    the configuration is not kvtier's)."""
    if not a.connector.startswith("kvtier"):
        return {}
    try:
        with open(a.snapshot) as f:
            m = json.load(f).get("manager") or {}
    except (OSError, ValueError):
        return {}
    keys = ("hit_blocks", "stored_blocks", "evicted_blocks", "skipped_slower_than_recompute")
    return {k: dict(m.get(k) or {}) for k in keys} | {"failed_loads": m.get("failed_loads", 0)}


def settled_counts(llm, a) -> dict:
    """``manager_counts`` once kvtier's transfers settled and its snapshot (rewritten every
    0.2 s) caught up; no wait for the other configurations."""
    if not a.connector.startswith("kvtier"):
        return {}
    settle(llm, a)
    time.sleep(0.5)
    return manager_counts(a)


def counts_delta(before: dict, after: dict) -> dict:
    """``after - before`` key by key (counters, or per-tier dicts of counters)."""
    out: dict = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = {t: n - before.get(k, {}).get(t, 0) for t, n in v.items()}
        else:
            out[k] = v - before.get(k, 0)
    return out


def replay(llm, a) -> dict:
    """Requests arrive at the trace's (compressed) times; TTFT from arrival to first token.
    Hit tokens per tier: vLLM's GPU prefix cache, and kvtier's tiers from its stats snapshot
    (``OffloadingConnector``'s hits are all CPU: vLLM's external hit counter)."""
    from vllm.inputs import TokensPrompt

    rows = trace_prompts(a)
    engine = llm.llm_engine
    kv_before = settled_counts(llm, a)
    before = metric_totals(llm)
    arrive: dict[str, float] = {}
    ttft: dict[str, float] = {}
    done: set[str] = set()
    i, start = 0, time.perf_counter()
    while len(done) < len(rows):
        now = time.perf_counter() - start
        while i < len(rows) and rows[i]["t"] <= now:
            rid = f"t{i}"
            engine.add_request(rid, TokensPrompt(prompt_token_ids=rows[i]["prompt"]),
                               sampling(rows[i]["out"]))
            arrive[rid] = start + rows[i]["t"]
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, rows[i]["t"] - now)) if i < len(rows) else 0.001)
            continue
        for o in engine.step():
            if o.request_id not in ttft and o.outputs and o.outputs[0].token_ids:
                ttft[o.request_id] = (time.perf_counter() - arrive[o.request_id]) * 1e3
            if o.finished:
                done.add(o.request_id)
    wall = time.perf_counter() - start
    after = metric_totals(llm)
    vals = sorted(ttft.values())
    delta = counts_delta(before, after)
    out = {"requests": len(rows), "seconds": wall, "requests_per_s": len(rows) / wall,
           "ttft_p50_ms": vals[len(vals) // 2], "ttft_p99_ms": vals[min(len(vals) - 1,
                                                                         int(len(vals) * .99))],
           "ttft_mean_ms": sum(vals) / len(vals),
           "trace_offset": a.trace_offset, "trace_chunks": a.trace_chunks,
           "trace_speedup": a.trace_speedup, "trace_span_s": rows[-1]["t"],
           "cpu_bytes": a.disk_cpu_bytes if a.connector == "kvtier_disk" else a.cpu_bytes,
           "gpu_kv_bytes": a.gpu_kv_bytes,
           "prompt_tokens": delta.get("vllm:prompt_tokens", 0),
           "gpu_hit_tokens": delta.get("vllm:prefix_cache_hits", 0),
           "external_hit_tokens": delta.get("vllm:external_prefix_cache_hits", 0)}
    if kv_before:
        kv = counts_delta(kv_before, settled_counts(llm, a))
        out["kvtier"] = kv
        out["hit_tokens_per_tier"] = {t: n * a.block_size for t, n in kv["hit_blocks"].items()}
    elif a.connector == "native":
        out["hit_tokens_per_tier"] = {"CPU": out["external_hit_tokens"]}
    return out
