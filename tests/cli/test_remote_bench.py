"""``kvtier bench`` with the shared tier, against a real server: ``--json`` reports
``blocks.REMOTE`` (a second run serves the first one's blocks), ``--shared`` reports the
two-instance hit rate against one instance of twice the CPU capacity and the GB/s its REMOTE
hops saw; the stats snapshot carries the REMOTE rows."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvtier.cli.main import cli as main
from kvtier.observe.metrics.exporter import metric_families
from support.valkey_fixtures import valkey  # noqa: F401 - pytest fixture


def write_config(tmp_path, url: str, snapshot: bool = False) -> str:
    path = tmp_path / "kvtier.yaml"
    text = f"tiers:\n  cpu:\n    capacity: 4MiB\n  remote:\n    url: {url}\n    capacity: 1GiB\n"
    if snapshot:
        text += f"stats:\n  snapshot_path: {tmp_path / 'snap.json'}\n  interval_s: 0.05\n"
    path.write_text(text)
    return str(path)


def bench(*args: str) -> dict:
    res = CliRunner().invoke(main, ["bench", "--json", "--limit", "40", "--block-kib", "64",
                                    *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_bench_json_reports_remote_blocks(tmp_path, valkey):
    server = valkey()
    cfg = write_config(tmp_path, server.url, snapshot=True)
    first = bench("--config", cfg)
    assert first["manager"]["stored_blocks"]["REMOTE"] > 0
    second = bench("--config", cfg)  # a new instance: only the shared tier remembers
    assert second["blocks"]["REMOTE"] >= first["blocks"]["REMOTE"] + first["blocks"]["MISS"] - 1
    assert second["blocks"]["MISS"] <= 1
    assert second["wrong_blocks"] == 0
    assert second["usage"]["REMOTE"]["capacity_blocks"] == (1 << 30) // (64 << 10)
    assert second["transfers"]["REMOTE->CPU"]["bytes"] > 0
    families = {f.name: f for f in metric_families(second)}
    assert any(s.labels.get("tier") == "REMOTE" and s.value > 0
               for s in families["kvtier_manager_hit_blocks"].samples)
    assert families["kvtier_remote_degraded"].samples[0].value == 0
    assert families["kvtier_remote_rejected"].samples[0].value == 0
    res = CliRunner().invoke(main, ["stats", "--snapshot", str(tmp_path / "snap.json"), "--json"])
    assert res.exit_code == 0, res.output
    stats = json.loads(res.output)
    assert stats["tiers"]["REMOTE"]["hit_blocks"] == second["blocks"]["REMOTE"]
    res = CliRunner().invoke(main, ["stats", "--config", cfg])
    assert res.exit_code == 0 and "REMOTE" in res.output and "shared tier ok" in res.output


def test_bench_shared_two_instances_vs_one(tmp_path, valkey):
    server = valkey()
    report = bench("--config", write_config(tmp_path, server.url), "--shared")
    assert report["wrong_blocks"] == 0
    assert report["second_instance_remote_hits"] > 0
    assert 0 < report["hit_rate_ratio"] <= 1.5
    assert report["replay_remote_gbps"]["load"] > 0
    assert report["replay_remote_gbps"]["store"] > 0


def test_bench_shared_needs_a_remote_tier(tmp_path):
    res = CliRunner().invoke(main, ["bench", "--shared", "--limit", "5"])
    assert res.exit_code != 0 and "tiers.remote" in res.output
