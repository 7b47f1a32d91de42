"""``kvtier stats`` on what a user's terminal and a hostile or full disk give it (issue 14):
the table fits 80 columns (item 20), crafted snapshots give a table or one error line, never a
traceback, and a snapshot writer on a full disk leaves no temp files behind (item 13)."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
from click.testing import CliRunner

from kvtier.cli.main import cli
from kvtier.runtime import snapshot as snapshot_mod
from kvtier.runtime.snapshot import SnapshotWriter, read_snapshot, write_snapshot

T, G = 2**40, 2**30
BIG = {  # a large, busy instance: the widest values each column meets
    "requests": {"hit_blocks": {"GPU": 123_456_789, "CPU": 98_765_432, "DISK": 1_234_567},
                 "hit_tokens": {"GPU": 10**10, "CPU": 5 * 10**9, "DISK": 10**9},
                 "miss_blocks": 10**8, "miss_tokens": 10**10},
    "usage": {"CPU": {"used_bytes": 31 * G + 5, "capacity_bytes": 32 * G, "used_blocks": 1_234_567},
              "DISK": {"used_bytes": int(1.99 * T), "capacity_bytes": 2 * T,
                       "used_blocks": 1_048_575}},
    "transfers": {d: {"jobs": 12_345_678, "failed_jobs": 12, "bytes": 123 * T, "seconds": 12345.678}
                  for d in ("GPU->CPU", "CPU->GPU", "CPU->DISK", "DISK->CPU", "DISK->DROP")},
    "manager": {"lookups": 123_456, "lookup_blocks": 1_234_567,
                "evicted_blocks": {"CPU": 123_456, "DISK": 1_234}},
    "disk": {"checksum_failures": 0, "compression_ratio": 1.2345},
    "events": {"batches": 1234, "dropped_events": 0},
}
HEADERS = ("tier", "blocks", "used", "capacity", "hit", "block", "token", "hit rate", "compr.",
           "ratio", "direction", "jobs", "failed", "bytes", "busy s", "GB/s")


def _snapshot(tmp_path, **fields):
    path = tmp_path / "kvtier-stats.json"
    path.write_text(json.dumps({"format": 1, "pid": os.getpid(), "written_at": time.time(),
                                **fields}))
    return path


def test_stats_table_fits_80_columns_without_cutting_a_header(tmp_path):
    path = _snapshot(tmp_path, **BIG)
    res = CliRunner().invoke(cli, ["stats", "--snapshot", str(path)], env={"COLUMNS": "80"},
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert max(map(len, lines)) <= 80, res.output
    assert "…" not in res.output, res.output
    for header in HEADERS:
        assert header in res.output, header
    for value in ("98.8M", "30.5%", "1.99 TiB", "2 TiB", "1.234", "12.3M", "123 TiB"):
        assert value in res.output, value  # compact, but there
    exact = json.loads(CliRunner().invoke(cli, ["stats", "--json", "--snapshot", str(path)]).output)
    assert exact["tiers"]["CPU"]["hit_blocks"] == 98_765_432


CRAFTED = {
    "pid beyond a C long": {"pid": 10**30},
    "pid beyond pid_t": {"pid": 2**40},
    "negative pid": {"pid": -5},
    "text counters": {"transfers": {"GPU->CPU": {"jobs": "x", "bytes": "lots", "seconds": "s",
                                                 "gbps": "g"}},
                      "requests": {"hit_blocks": {"CPU": "x"}, "hit_tokens": {"CPU": "a"},
                                   "miss_blocks": "m"},
                      "usage": {"CPU": {"used_bytes": "x", "capacity_bytes": None}},
                      "manager": {"hit_blocks": {"CPU": "x"}, "lookup_blocks": "y"},
                      "disk": {"compression_ratio": "x"}},
    "huge int": {"requests": {"hit_blocks": {"CPU": 10**400}, "miss_blocks": 1}},
    "huge bytes": {"usage": {"CPU": {"used_bytes": 10**400, "capacity_bytes": 1e300}}},
    "huge transfer": {"transfers": {"GPU->CPU": {"jobs": 1, "bytes": 10**400, "seconds": 1e300}}},
    "huge timestamp": {"written_at": 1e300},
    "a list of events": {"events": {"batches": "x", "dropped_events": [1]}},
}


@pytest.mark.parametrize("name", CRAFTED)
@pytest.mark.parametrize("as_json", [False, True])
def test_crafted_snapshot_gives_a_table_or_one_error_line(tmp_path, name, as_json):
    path = _snapshot(tmp_path, **CRAFTED[name])
    for target in (["--snapshot", str(path)], ["--dir", str(tmp_path)]):
        args = ["stats", *target] + (["--json"] if as_json else [])
        res = CliRunner().invoke(cli, args)
        assert res.exception is None or isinstance(res.exception, SystemExit), (
            name, repr(res.exception))
        assert res.exit_code in (0, 2), res.output
        if res.exit_code == 2:
            assert res.output.count("\n") == 1 and "snapshot" in res.output


def test_counters_keep_numbers_only(tmp_path):
    snap = read_snapshot(_snapshot(tmp_path, **CRAFTED["text counters"]))
    assert snap["requests"] == {"hit_blocks": {}, "hit_tokens": {}}
    assert snap["transfers"] == {"GPU->CPU": {}}
    good = read_snapshot(_snapshot(tmp_path, **BIG))
    assert good["requests"] == BIG["requests"] and good["transfers"] == BIG["transfers"]


def test_snapshot_writer_on_a_full_disk_leaves_no_temp_files(tmp_path, monkeypatch):
    path = tmp_path / "kvtier-stats.json"
    write_snapshot(path, {"manager": {"lookups": 1}})

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(snapshot_mod.json, "dump", no_space)
    writer = SnapshotWriter(path, lambda: {"manager": {"lookups": 2}}, interval_s=3600)
    for _ in range(5):  # what five intervals on a full disk do
        writer.write_now()
    with pytest.raises(OSError):
        write_snapshot(path, {})
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvtier-stats.json"]
    assert read_snapshot(path)["manager"] == {"lookups": 1}  # the last good one stays


def test_stats_shows_cost_aware_loadings_view_of_each_tier(tmp_path):
    """The shared tier's speed decides whether its hits are loaded: ``kvtier stats`` says what
    recompute costs, what each tier measured, and how many blocks were recomputed instead."""
    cost = {"load_gbps": {"CPU": 48.2, "REMOTE": 1.9}, "measured": {"CPU": 12, "REMOTE": 2},
            "fixed_ms": {}, "fixed_measured": {}, "recompute_ms_per_block": 0.6,
            "break_even_gbps": 3.4, "cuts": 5, "probes": 0}
    manager = {"lookups": 9, "skipped_slower_than_recompute": {"CPU": 0, "REMOTE": 2560}}
    path = _snapshot(tmp_path, manager=manager, cost=cost)
    res = CliRunner().invoke(cli, ["stats", "--snapshot", str(path)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    # a 200-column terminal still gets lines of at most 80 columns (the long one wrapped)
    assert max(len(ln) for ln in res.output.splitlines()) <= 80, res.output
    line = " ".join(res.output[res.output.index("cost-aware loading"):].split())  # unwrapped
    assert "recompute 0.6 ms/block" in line and "above 3.4 GB/s" in line
    assert "REMOTE 1.90 GB/s (2 samples, 2560 blocks recomputed instead)" in line
    assert "CPU 48.20 GB/s (12 samples)" in line and "lookups cut 5" in line
    # a tier whose loads of different sizes split into a per-load latency and a bandwidth
    cost.update(load_gbps={"CPU": 48.2, "REMOTE": 16.1}, latency_ms={"CPU": 0.0, "REMOTE": 41.7},
                explorations=2)
    path = _snapshot(tmp_path, manager=manager, cost=cost)
    res = CliRunner().invoke(cli, ["stats", "--snapshot", str(path)], env={"COLUMNS": "200"})
    line = " ".join(res.output[res.output.index("cost-aware loading"):].split())  # unwrapped
    assert "REMOTE 16.10 GB/s + 41.7 ms per load (2 samples" in line
    assert "CPU 48.20 GB/s (12 samples)" in line
    assert "explorations of larger loads 2" in line
