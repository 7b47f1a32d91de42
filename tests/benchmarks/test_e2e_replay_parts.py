"""The pieces of the real-vLLM harness (``benchmarks/vllm_e2e_replay.py``, ``host_probe.py``) that shape the GPU figures without a GPU:
the trace window the replay sends, kvtier's per-tier counters around it, and the per-thread
CPU accounting of a timed request."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import pytest


import host_probe
import vllm_e2e_replay as replay


def _trace(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _args(trace, **kw):
    base = dict(trace=trace, trace_offset=0, trace_requests=10, trace_chunks=4,
                trace_speedup=2.0, trace_max_out=8, max_len=4096, vocab=1000)
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_trace_window_starts_at_its_offset_and_shares_chunks_by_hash_id(tmp_path):
    rows = [{"timestamp": 1000 * i, "input_length": 1024, "output_length": 3,
             "hash_ids": [i, 100 + i]} for i in range(5)]
    rows[4]["hash_ids"] = [2, 200]  # shares its first chunk with request 2
    a = _args(_trace(tmp_path, rows), trace_offset=2, trace_requests=2)
    got = replay.trace_prompts(a)
    assert len(got) == 2  # requests 2 and 3 only
    assert got[0]["t"] == 0.0 and got[1]["t"] == 1000 / 1e3 / 2.0  # from the window's start
    full = replay.trace_prompts(_args(a.trace))
    assert got[0]["prompt"] == full[2]["prompt"]  # the same tokens as without the offset
    # request 4 starts with request 2's chunk: a real shared prefix of 512 tokens
    assert full[4]["prompt"][:512] == full[2]["prompt"][:512]
    assert full[4]["prompt"][512:] != full[2]["prompt"][512:]
    assert all(len(r["prompt"]) == 1024 and r["out"] == 3 for r in full)


def test_kvtier_counters_around_a_replay_are_deltas_per_tier(tmp_path):
    snap = tmp_path / "stats.json"
    a = argparse.Namespace(connector="kvtier", snapshot=str(snap))
    assert replay.manager_counts(a) == {}  # no snapshot yet: nothing, not an error
    snap.write_text(json.dumps({"manager": {
        "hit_blocks": {"CPU": 5, "DISK": 1}, "stored_blocks": {"CPU": 10, "DISK": 0},
        "evicted_blocks": {"CPU": 0, "DISK": 0},
        "skipped_slower_than_recompute": {"CPU": 0, "DISK": 2}, "failed_loads": 1}}))
    before = replay.manager_counts(a)
    snap.write_text(json.dumps({"manager": {
        "hit_blocks": {"CPU": 12, "DISK": 4}, "stored_blocks": {"CPU": 30, "DISK": 7},
        "evicted_blocks": {"CPU": 3, "DISK": 0},
        "skipped_slower_than_recompute": {"CPU": 1, "DISK": 2}, "failed_loads": 1}}))
    d = replay.counts_delta(before, replay.manager_counts(a))
    assert d["hit_blocks"] == {"CPU": 7, "DISK": 3}
    assert d["stored_blocks"] == {"CPU": 20, "DISK": 7}
    assert d["skipped_slower_than_recompute"] == {"CPU": 1, "DISK": 0}
    assert d["failed_loads"] == 0
    assert replay.manager_counts(argparse.Namespace(connector="native", snapshot=str(snap))) == {}


def test_a_busy_thread_shows_up_by_name_in_a_requests_cpu_accounting():
    if not os.path.exists("/proc/self/task/%d/schedstat" % threading.get_native_id()):
        pytest.skip("no per-thread schedstat on this kernel (the harness then omits the field)")
    stop = threading.Event()
    started = threading.Event()

    def spin():
        started.set()
        while not stop.is_set():
            sum(i * i for i in range(1000))

    t = threading.Thread(target=spin, name="busy-neighbour", daemon=True)
    t.start()
    started.wait()
    before = host_probe.thread_cpu()
    time.sleep(0.2)
    got = host_probe.thread_cpu_delta(before)
    stop.set()
    t.join()
    assert "busy-neighbour" in got, got
    on_cpu, waiting = got["busy-neighbour"]
    assert on_cpu >= 20.0 and waiting >= 0.0  # it ran for much of the 200 ms
    assert "MainThread" not in got or got["MainThread"][0] < on_cpu  # the sleeper did not
