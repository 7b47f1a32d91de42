"""What a new user met in the CLI (issue 37): options silently ignored, an empty config taken
as "defaults", a REMOTE row and "shared tier ok" without a shared tier, no ``--version``, a
``--compare`` table and help texts wider than 80 columns, a minute with no output."""

from __future__ import annotations

import json
import os
import time
from importlib import metadata

import pytest
from click.testing import CliRunner

from kvtier.cli import progress as progress_mod
from kvtier.cli.main import cli


def invoke(*args, env=None):
    return CliRunner().invoke(cli, list(args), env=env)


def one_error_line(res, needle: str) -> None:
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    assert res.stderr.startswith("kvtier: error: ") and res.stderr.count("\n") == 1, res.stderr
    assert needle in res.stderr, res.stderr


# -- 0 silently ignored options ------------------------------------------------------------------

IGNORED = {
    "compare --shared": (["bench", "--compare", "--shared"], "--shared"),
    "compare --overlap": (["bench", "--compare", "--overlap"], "--overlap"),
    "compare --block-kib": (["bench", "--compare", "--block-kib", "8"], "--block-kib"),
    "compare --block-kib default value": (["bench", "--compare", "--block-kib", "64"],
                                          "--block-kib"),
    "policies without compare": (["bench", "--policies", "arc"], "--policies"),
    "capacities without compare": (["bench", "--capacity-blocks", "10"], "--capacity-blocks"),
    "shared --overlap": (["bench", "--shared", "--overlap"], "--overlap"),
    "timeout without url": (["stats", "--dir", ".", "--timeout", "3"], "--timeout"),
    "count without watch": (["stats", "--dir", ".", "--count", "2"], "--count"),
    "interval without watch": (["stats", "--dir", ".", "--interval", "1"], "--interval"),
    "url and config": (["stats", "--url", "http://127.0.0.1:1/metrics", "--config", "x.yaml"],
                       "give one of --url and --config"),
    "snapshot and dir": (["stats", "--snapshot", "s.json", "--dir", "."],
                         "give one of --snapshot and --dir"),
}


@pytest.mark.parametrize("case", IGNORED)
def test_an_option_the_mode_does_not_use_is_refused(case):
    args, needle = IGNORED[case]
    one_error_line(invoke(*args), needle)


def test_options_of_the_mode_are_still_accepted(generated_trace):
    res = invoke("bench", "--compare", "--trace", generated_trace("zipf", 40, seed=2),
                 "--capacity-blocks", "20", "--policies", "arc", "--json", "--limit", "30")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["requests"] == 30


# -- an empty config is an error ------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "null\n", "~\n"])
@pytest.mark.parametrize("command", ["bench", "stats"])
def test_an_empty_config_is_one_error_line(tmp_path, text, command):
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(text)
    one_error_line(invoke(command, "--config", str(cfg)), "holds no settings")


# -- stats without a shared tier ------------------------------------------------------------------

def _snapshot(tmp_path, usage: dict) -> str:
    path = tmp_path / "kvtier-stats.json"
    path.write_text(json.dumps({
        "format": 1, "pid": os.getpid(), "written_at": time.time(),
        "requests": {"hit_blocks": {"CPU": 5, "DISK": 1, "REMOTE": 0},
                     "hit_tokens": {"CPU": 80, "DISK": 16, "REMOTE": 0},
                     "miss_blocks": 4, "miss_tokens": 64},
        "usage": usage,
        "manager": {"lookups": 3, "lookup_blocks": 10, "remote_degraded": False},
    }))
    return str(path)


CPU_USAGE = {"CPU": {"used_blocks": 6, "capacity_blocks": 64}}


def test_stats_shows_no_shared_tier_when_none_is_configured(tmp_path):
    res = invoke("stats", "--snapshot", _snapshot(tmp_path, CPU_USAGE))
    assert res.exit_code == 0, res.output
    assert "REMOTE" not in res.output and "shared tier" not in res.output, res.output
    data = json.loads(invoke("stats", "--json", "--snapshot",
                             _snapshot(tmp_path, CPU_USAGE)).stdout)
    assert "REMOTE" not in data["tiers"] and data["tiers"]["CPU"]["hit_blocks"] == 5


def test_stats_shows_the_shared_tier_when_the_instance_has_one(tmp_path):
    usage = {**CPU_USAGE, "REMOTE": {"used_blocks": 3, "capacity_blocks": 100}}
    res = invoke("stats", "--snapshot", _snapshot(tmp_path, usage))
    assert res.exit_code == 0, res.output
    assert "REMOTE" in res.output and "shared tier ok" in res.output, res.output


# -- --version, help and tables in 80 columns -----------------------------------------------------

def test_version_is_the_installed_distributions():
    res = invoke("--version")
    assert res.exit_code == 0
    assert res.stdout.strip() == f"kvtier {metadata.version('kvtier')}"
    assert invoke("-V").stdout == res.stdout


@pytest.mark.parametrize("columns", ["80", "200"])
@pytest.mark.parametrize("command", [[], ["bench"], ["stats"], ["events"]])
def test_every_help_fits_80_columns(command, columns):
    res = invoke(*command, "--help", env={"COLUMNS": columns})
    assert res.exit_code == 0, res.output
    wide = [line for line in res.stdout.splitlines() if len(line) > 80]
    assert not wide, wide


def test_top_level_help_names_the_shared_tier():
    out = invoke("--help").stdout
    assert "shared" in out and "Redis/Valkey" in out and "--version" in out


def test_compare_table_fits_80_columns(generated_trace):
    res = invoke("bench", "--compare", "--trace", generated_trace("multiturn", 300),
                 "--capacity-blocks", "60,12000",
                 "--policies", "arc+reuse_gate+hints,lru+threshold")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    assert any(line.startswith("| 12,000 | arc+reuse_gate+hints |") for line in lines)
    assert "| inf | infinite |" in res.stdout


# -- progress on stderr ---------------------------------------------------------------------------

def test_compare_reports_progress_on_stderr(monkeypatch, generated_trace):
    monkeypatch.setattr(progress_mod, "PLAIN_EVERY_S", 0.0)
    res = invoke("bench", "--compare", "--trace", generated_trace("zipf", 60),
                 "--capacity-blocks", "20,40", "--policies", "arc", "--json")
    assert res.exit_code == 0, res.output
    json.loads(res.stdout)  # stdout stays the report alone
    assert "kvtier: 0/4 policy runs (C=20 lru)" in res.stderr, res.stderr
    assert "kvtier: 3/4 policy runs (C=40 arc)" in res.stderr, res.stderr


def test_replay_reports_progress_on_stderr(monkeypatch):
    monkeypatch.setattr(progress_mod, "PLAIN_EVERY_S", 0.0)
    res = invoke("bench", "--limit", "4", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["requests"] == 4
    assert "kvtier: 4/4 requests replayed" in res.stderr, res.stderr


def test_progress_stays_quiet_off_a_terminal_for_a_short_run(generated_trace):
    res = invoke("bench", "--compare", "--trace", generated_trace("zipf", 60),
                 "--capacity-blocks", "20", "--policies", "arc", "--json")
    assert res.exit_code == 0 and res.stderr == "", res.stderr


# -- stats on a config whose disk tier was never used ----------------------------------------------

def test_stats_on_a_fresh_config_creates_nothing_and_shows_the_disk_tier_absent(tmp_path):
    """``stats`` only reads: a disk path no instance has created yet stays absent (it once
    made the whole tree, mode 0700), and the output says so."""
    cfg = tmp_path / "kvtier.yaml"
    path = tmp_path / "not" / "there" / "disk"
    cfg.write_text(f"tiers:\n  disk: {{path: {path}, capacity: 1GiB}}\n")
    res = invoke("stats", "--json", "--config", str(cfg))
    assert res.exit_code == 0, res.output
    disk = json.loads(res.stdout)["tiers"]["DISK"]
    assert disk == {"path": str(path), "capacity_bytes": 1 << 30, "exists": False}
    text = invoke("stats", "--config", str(cfg))
    assert text.exit_code == 0, text.output
    assert "does not exist yet" in " ".join(text.stdout.split())
    assert not (tmp_path / "not").exists()


def test_stats_on_a_created_but_unused_disk_tier_shows_it_empty(tmp_path):
    cfg = tmp_path / "kvtier.yaml"
    (tmp_path / "disk").mkdir()
    cfg.write_text(f"tiers:\n  disk: {{path: {tmp_path / 'disk'}, capacity: 1GiB}}\n")
    res = invoke("stats", "--json", "--config", str(cfg))
    assert res.exit_code == 0, res.output
    disk = json.loads(res.stdout)["tiers"]["DISK"]
    assert disk["blocks"] == 0 and disk["capacity_bytes"] == 1 << 30
