"""``kvtier bench`` and ``kvtier stats`` end to end, through the installed entry points."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvtier.cli.main import cli


def run_cli(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def write_config(tmp_path, disk_dir, cpu="4MiB", disk="64MiB"):
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(
        "tiers:\n"
        f"  cpu: {{capacity: {cpu}, eviction: lru}}\n"
        f"  disk: {{path: {disk_dir}, capacity: {disk}, compression: zstd, fsync: true}}\n"
    )
    return cfg


def test_bench_default_runs_and_hits_every_tier():
    result = run_cli("bench", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stderr may hold a progress line on a slow machine
    assert report["requests"] == 400
    assert report["wrong_blocks"] == 0 and report["failed_jobs"] == 0
    for tier in ("GPU", "CPU", "DISK", "MISS"):
        assert report["blocks"][tier] > 0, tier
    assert sum(report["blocks"].values()) == sum(len(r["hash_ids"]) for r in map(json.loads, open(
        os.path.join(os.path.dirname(__file__), "..", "..", "kvtier", "data", "sample_trace.jsonl"))))
    assert report["transfers"]["GPU->CPU"]["bytes"] > 0 and report["transfers"]["DISK->CPU"]["bytes"] > 0
    assert report["disk"]["compression_ratio"] > 1.0


def test_bench_table_output_mentions_tiers():
    result = run_cli("bench", "--limit", "60")
    assert result.exit_code == 0
    for word in ("GPU", "CPU", "DISK", "MISS", "GB/s", "wrong blocks served: 0"):
        assert word in result.output


def test_disk_tier_survives_restart_and_stats_reads_it(tmp_path):
    disk_dir = tmp_path / "disk"
    cfg = write_config(tmp_path, disk_dir)
    first = json.loads(run_cli("bench", "--json", "--config", str(cfg), "--limit", "150").stdout)
    assert first["disk"]["num_blocks"] > 0
    # Same trace again in a new manager: GPU and CPU start empty, so hits must come from disk.
    second = json.loads(run_cli("bench", "--json", "--config", str(cfg), "--limit", "150").stdout)
    assert second["blocks"]["DISK"] > first["blocks"]["DISK"]
    assert second["wrong_blocks"] == 0
    out = run_cli("stats", "--json", "--config", str(cfg))
    assert out.exit_code == 0
    stats = json.loads(out.output)
    disk = stats["tiers"]["DISK"]
    assert disk["blocks"] == second["disk"]["num_blocks"] and disk["capacity_bytes"] == 64 * 2**20
    assert disk["oldest"] and disk["newest"]
    inst = stats["instance"]  # snapshot written by the (finished) bench in this process
    assert inst is not None and inst["manager"]["hit_blocks"]["DISK"] == second["manager"]["hit_blocks"]["DISK"]
    table = run_cli("stats", "--dir", str(disk_dir))
    assert table.exit_code == 0 and "DISK" in table.output


def test_bad_config_exits_2_without_traceback(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tiers:\n  cpu: {capacty: 1GiB}\n")
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "--config", str(cfg)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "bad.yaml:2" in proc.stderr and "capacity" in proc.stderr


def test_bad_trace_exits_2_naming_the_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"oops": 1}\n')
    result = CliRunner().invoke(cli, ["bench", "--trace", str(trace)])
    assert result.exit_code == 2 and f"{trace}:2" in result.output


def test_stats_needs_a_target_and_rejects_missing_dir(tmp_path):
    assert CliRunner().invoke(cli, ["stats"]).exit_code == 2
    result = CliRunner().invoke(cli, ["stats", "--dir", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "no such directory" in result.output


def test_help_lists_commands():
    out = run_cli("--help").output
    assert "bench" in out and "stats" in out
    assert "--trace" in run_cli("bench", "--help").output
