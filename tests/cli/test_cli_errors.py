"""One error style for every CLI error, and ``--compare`` defaults that tell policies apart
(issue 14, item 22). Users met two styles: click's four-line "Usage: ... Error: ..." and
kvtier's "kvtier: error: ...". Now both are one line on stderr, status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvtier.cli.main import cli


def _bad_inputs(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("tiers:\n  cpu: {capacty: 1GiB}\n")
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"oops": 1}\n')
    return {
        "usage": (["bench", "--compare", "--overlap"], "not used by --compare"),
        "unknown option": (["bench", "--nope"], "--nope"),
        "bad value": (["bench", "--compare", "--capacity-blocks", "a"], "--capacity-blocks"),
        "missing target": (["stats"], "--config"),
        "unknown command": (["nosuch"], "nosuch"),
        "config": (["bench", "--config", str(cfg)], "bad.yaml:2"),
        "trace": (["bench", "--trace", str(trace)], "t.jsonl:1"),
    }


@pytest.mark.parametrize("case", ["usage", "unknown option", "bad value", "missing target",
                                  "unknown command", "config", "trace"])
def test_every_error_is_one_kvtier_error_line(tmp_path, case):
    args, needle = _bad_inputs(tmp_path)[case]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    assert res.stderr.startswith("kvtier: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert needle in res.stderr and "Usage:" not in res.stderr


def test_installed_entry_point_uses_the_same_style():
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "--limit", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("kvtier: error: ") and proc.stderr.count("\n") == 1
    assert "(see 'kvtier bench --help')" in proc.stderr


def test_plain_kvtier_prints_help():
    res = CliRunner().invoke(cli, [])
    assert res.exit_code == 0 and "bench" in res.stdout and "stats" in res.stdout


def test_compare_defaults_tell_capacities_and_policies_apart():
    res = CliRunner().invoke(cli, ["bench", "--compare", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)["rows"]
    caps = sorted({r["capacity"] for r in rows})
    assert len(caps) == 3
    lru = {r["capacity"]: r["hit_rate"] for r in rows if r["policy"] == "lru"}
    assert lru[caps[0]] < lru[caps[1]] < lru[caps[2]]  # no capacity holds the whole sample
    smallest = {r["policy"]: r["hit_rate"] for r in rows if r["capacity"] == caps[0]}
    assert len(set(smallest.values())) > 2  # the policies differ where it matters


@pytest.mark.parametrize("args", [["--gpu-blocks", str(10**9)],
                                  ["--block-kib", str(10**9), "--gpu-blocks", "64"]])
def test_simulated_gpu_larger_than_memory_is_refused(args):
    res = CliRunner().invoke(cli, ["bench", "--limit", "2", *args])
    assert res.exit_code == 2 and res.stderr.count("\n") == 1, res.output
    assert "simulated GPU" in res.stderr
