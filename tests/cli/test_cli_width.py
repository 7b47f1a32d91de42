"""Every line kvtier prints to a terminal fits 80 columns, however wide the terminal says it is
(``COLUMNS=200`` here): a long error is wrapped at word boundaries with nothing lost, event
lines shorten their hashes, tables lay out within 80 (issue 49: errors reached 197 columns,
``kvtier events`` lines 122). Outside a terminal an error stays one line, for logs and scripts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtier.cli import terminal
from kvtier.cli.events_cmd import item_lines
from kvtier.cli.main import cli
from kvtier.observe.events import BlockAccessed, BlockRemoved, BlockStored, Delivery, Gap
from kvtier.observe.events.wire import KvtierEventBatch

WIDE = {"COLUMNS": "200"}
ROOT = Path(__file__).resolve().parents[2]


def _bad_config(tmp_path):
    """A config error of well over 80 columns: path, key, problem and what is allowed."""
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("tiers:\n  cpu:\n    capacity: -1GiB\n")
    return cfg


def test_a_long_error_at_a_terminal_is_wrapped_to_80_columns_with_nothing_lost(
        tmp_path, monkeypatch):
    cfg = _bad_config(tmp_path)
    piped = CliRunner().invoke(cli, ["stats", "--config", str(cfg)], env=WIDE)
    assert piped.exit_code == 2 and piped.stderr.count("\n") == 1  # a log gets one line
    one_line = piped.stderr.strip()
    assert len(one_line) > 100 and one_line.startswith("kvtier: error: ")

    monkeypatch.setattr(terminal, "stderr_is_terminal", lambda: True)
    res = CliRunner().invoke(cli, ["stats", "--config", str(cfg)], env=WIDE)
    assert res.exit_code == 2
    lines = res.stderr.splitlines()
    assert len(lines) > 1 and max(map(len, lines)) <= 80, res.stderr
    assert lines[0].startswith("kvtier: error:")
    assert all(line.startswith("  ") for line in lines[1:])  # one message, continued
    # the same text: only line breaks added (a word longer than a line, such as a deep
    # path, is broken inside, hence the comparison without whitespace)
    assert "".join(res.stderr.split()) == "".join(one_line.split())
    assert "(allowed: a size such as" in " ".join(res.stderr.split())


def test_a_usage_error_at_a_terminal_fits_too(monkeypatch):
    monkeypatch.setattr(terminal, "stderr_is_terminal", lambda: True)
    res = CliRunner().invoke(cli, ["events", "--endpoint", "tcp://127.0.0.1:99999"], env=WIDE)
    assert res.exit_code == 2
    assert max(map(len, res.stderr.splitlines())) <= 80, res.stderr
    assert "a tcp endpoint needs a host and a port" in " ".join(res.stderr.split())


def test_a_narrow_terminal_gets_narrower_lines():
    text = "kvtier: error: " + "word " * 30
    assert max(map(len, terminal.wrapped(text, 50).splitlines())) <= 50
    assert terminal.wrapped(text, None) == " ".join(text.split())


def _batch(seq: int, events, access=(), replayed=True) -> Delivery:
    ts = datetime(2026, 12, 7, 12, 34, 56).timestamp()
    return Delivery(seq, KvtierEventBatch(ts=ts, events=list(events), access=list(access),
                                          data_parallel_rank=0), replayed)


@pytest.mark.parametrize("seq", [7, 123_456_789_012])
def test_event_lines_fit_80_columns(seq):
    many = [bytes([i]) * 32 for i in range(40)]
    batch = _batch(seq, [BlockStored(many, many[0] * 2, list(range(2048)), 16, None, "STORAGE",
                                     None),
                         BlockRemoved(many, "STORAGE")],
                   [BlockAccessed(many, "STORAGE", 655_360)])
    lines = item_lines(batch) + item_lines(Gap(10 ** 12, 10 ** 12 + 5, "replay history gone"))
    assert len(lines) == 4
    assert max(map(len, lines)) <= 80, lines
    if seq > 10 ** 6:
        return  # the head alone takes most of the line: cut, never wider
    stored, removed, hit = lines[:3]
    assert "stored  STORAGE   40 blocks [" in stored and "2048 tokens" in stored
    assert "+" in stored  # the hashes that did not fit are counted
    assert "removed STORAGE" in removed and "hit     STORAGE" in hit


def test_event_lines_keep_every_hash_that_fits():
    few = [bytes([i]) * 32 for i in range(2)]
    (line,) = item_lines(_batch(3, [BlockRemoved(few, "CPU")], replayed=False))
    assert f"[{few[0].hex()[:8]} {few[1].hex()[:8]}]" in line and "+" not in line


def test_tables_fit_80_columns_on_a_wide_terminal():
    res = CliRunner().invoke(cli, ["bench", "--limit", "40"], env=WIDE)
    assert res.exit_code == 0, res.output
    assert "GB/s" in res.stdout
    assert max(map(len, res.stdout.splitlines())) <= 80, res.stdout


def test_help_fits_80_columns_on_a_wide_terminal():
    """In its own process: click's test runner forces its own help width."""
    env = {**os.environ, **WIDE, "PYTHONPATH": str(ROOT)}
    for args in ([], ["bench"], ["stats"], ["events"]):
        out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args, "--help"],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        assert max(map(len, out.stdout.splitlines())) <= 80, args
