"""Security of everything kvtier reads back: crafted bytes never run code and never crash.

* A pickle payload (whose unpickling would create a marker file) and a torch.save file are fed
  into every reader: disk records and segment files, every LMDB sub-database of the index, the
  stats snapshot reader, the trace reader, the config loader, the event wire decoder and the
  metrics parser. Unpicklers, ``torch.load``, ``marshal`` and ``eval``/``exec`` are tripwired
  while they run, and a static scan keeps such calls out of the package.
* Store directories and files are private (0700 / 0600 even under umask 0); a directory owned
  by another user, world-writable, or with a planted symlink is refused with a clear message.
* Hypothesis fuzzing of what tests/cli/test_trace.py and tests/config/test_config.py do not cover: whole
  trace files as bytes, deep nesting, non-finite numbers, config files as bytes, environment
  overrides, and stats snapshots of arbitrary JSON.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import marshal
import math
import os
import pickle
import stat
import struct
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from reliability.blocks import GEO, block, key

import kvtier
from kvtier.bench.trace import TraceError, load_trace, parse_line
from kvtier.cli.stats_cmd import collect_stats, print_stats
from kvtier.config import ENV_OVERRIDES, ConfigError, KvtierConfig, load_config
from kvtier.observe.events.wire import DecodeError, decode_batch, decode_gap
from kvtier.manager.tiered import TieredOffloadingManager
from kvtier.observe.metrics.scrape import ScrapeError, parse as parse_metrics
from kvtier.runtime.snapshot import read_snapshot, write_snapshot
from kvtier.tiers.disk import (
    DiskIndexUnreadable,
    DiskLayoutMismatch,
    DiskStore,
    NotADiskStore,
    UnsafeDiskDirectory,
)
from kvtier.tiers.disk.catalog.index import IndexWriter

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
REC = 56 + 16 + GEO.block_bytes


# -- payloads and tripwires ----------------------------------------------------------------

class Pwn:
    """Unpickling (or torch.load-ing) this creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "a crafted payload was deserialized and ran code"


@pytest.fixture
def payloads(marker):
    buf = io.BytesIO()
    torch.save({"kv": Pwn(marker)}, buf)
    return {
        "pickle": pickle.dumps(Pwn(marker), protocol=2),
        "pickle5": pickle.dumps([Pwn(marker)] * 3, protocol=5),
        "torch": buf.getvalue(),
        "yaml_tag": f"!!python/object/apply:builtins.open ['{marker}', 'w']\n".encode(),
    }


@contextmanager
def tripwires():
    """Every way of turning bytes into code, rigged to record (and refuse) being called."""
    calls: list[str] = []

    def trap(name):
        def refuse(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called on untrusted input")
        return refuse

    targets = [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load"),
               (marshal, "loads"), (yaml, "unsafe_load"), (yaml, "full_load"),
               (builtins, "eval"), (builtins, "exec")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    for mod, name in targets:
        setattr(mod, name, trap(f"{mod.__name__}.{name}"))
    try:
        yield calls
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)
    assert calls == [], calls


def _seg(root: Path, seg: int) -> Path:
    return root / "segments" / f"{seg:08d}.seg"


def _store(path: Path, n: int = 6) -> list[bytes]:
    keys = [key(i) for i in range(n)]
    with DiskStore(path, GEO, segment_bytes=3 * REC) as s:
        s.put_many([(k, block(k)) for k in keys])
    return keys


# -- disk records and segment files ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["pickle", "pickle5", "torch"])
def test_crafted_bytes_in_segment_files_are_misses(tmp_path, payloads, kind):
    path = tmp_path / "d"
    keys = _store(path)
    data = payloads[kind]
    with DiskStore(path, GEO, segment_bytes=3 * REC) as s:
        e = s._index.get(keys[1])
    with open(_seg(path, e.segment), "r+b") as f:  # a record replaced by the payload
        f.seek(e.offset)
        f.write(data[: e.length].ljust(min(e.length, len(data)), b"\0"))
    _seg(path, 90).write_bytes(data)  # a whole segment file nobody indexed
    with tripwires(), DiskStore(path, GEO, segment_bytes=3 * REC) as s:
        assert not _seg(path, 90).exists()  # unknown segment files are removed at open
        with open(_seg(path, s._files.active_id), "ab") as f:  # garbage after the indexed end
            f.write(data)
        assert s.get(keys[1]) is None
        assert s.stats().checksum_failures == 1
        for k in keys[3:]:
            assert s.get(k) == block(k)
    with tripwires(), DiskStore(path, GEO, segment_bytes=3 * REC) as s:  # tail cut at reopen
        assert s.get(keys[-1]) == block(keys[-1])
        s.put_many([(key(50), block(key(50)))])
        assert s.get(key(50)) == block(key(50))


# -- every LMDB sub-database of the index ----------------------------------------------------

def _poison(path: Path, db: str, k: bytes, v: bytes) -> None:
    with DiskStore(path, GEO, segment_bytes=3 * REC) as s, IndexWriter(s._index) as w:
        w.txn.put(k, v, db=getattr(s._index, db))


@pytest.mark.parametrize("db, which", [
    ("blocks", "value"), ("blocks", "key"), ("segments", "value"), ("segments", "key"),
    ("locs", "key"), ("locs", "value"), ("ages", "value"), ("ages", "key"),
])
def test_crafted_index_entries_are_misses_or_ignored(tmp_path, payloads, db, which):
    path = tmp_path / "d"
    keys = _store(path)
    bad = payloads["pickle"]
    if db == "segments" and which == "value":
        target_key = (1).to_bytes(8, "little")  # segment 1's accounting record
    elif db == "blocks" and which == "value":
        target_key = keys[0]
    elif db == "locs" and which == "value":
        target_key = struct.pack(">IQ", 1, 0)  # the location of the first record
    else:
        target_key = bad[:200] if which == "key" else keys[0]
    value = bad if which == "value" else keys[0]
    if db == "ages" and which == "value":
        target_key = (10**6).to_bytes(8, "big")
    _poison(path, db, target_key, value)
    with tripwires(), DiskStore(path, GEO, segment_bytes=3 * REC) as s:
        listed = s.keys_by_age()
        assert len(listed) == len(set(listed))
        TieredOffloadingManager(cpu_blocks=4, disk_blocks=16, initial_disk_keys=listed)
        for k in listed + keys + [bad[:200]]:
            got = s.get(k)
            assert got is None or got == block(k)
        survivors = [k for k in keys if s.get(k) is not None]
        assert len(survivors) >= 3  # damage stays local
        s.delete_many(keys[:2])
        s.compact()
        s.put_many([(key(60), block(key(60)))])
        assert s.get(key(60)) == block(key(60))
        st_ = s.stats()
        assert st_.num_blocks >= 1
    with tripwires():
        DiskStore.read_stats(path)


@pytest.mark.parametrize("name, error", [("fingerprint", DiskLayoutMismatch),
                                         ("format_version", DiskLayoutMismatch),
                                         ("next_seq", None), ("next_segment", None),
                                         ("geometry", None), ("checksum_failures", None)])
def test_crafted_index_metadata_is_refused_clearly_or_ignored(tmp_path, payloads, name, error):
    path = tmp_path / "d"
    keys = _store(path)
    _poison(path, "meta", name.encode(), payloads["pickle"])
    with tripwires():
        stats = DiskStore.read_stats(path)
        assert isinstance(stats.geometry, str)
        if error is not None:
            with pytest.raises(error, match=str(path)):
                DiskStore(path, GEO)
            return
        with DiskStore(path, GEO, segment_bytes=3 * REC) as s:
            assert all(s.get(k) == block(k) for k in keys)
            s.put_many([(key(70), block(key(70)))])
            assert s.get(key(70)) == block(key(70))


@pytest.mark.parametrize("name, value", [("next_seq", (2**64 - 1).to_bytes(8, "little")),
                                         ("next_segment", (2**40).to_bytes(8, "little"))])
def test_impossible_index_counters_are_a_clear_error(tmp_path, name, value):
    path = tmp_path / "d"
    _store(path)
    _poison(path, "meta", name.encode(), value)
    with pytest.raises(DiskIndexUnreadable, match="damaged"):
        DiskStore(path, GEO)


def test_crafted_lmdb_file_is_a_clear_error(tmp_path, payloads):
    path = tmp_path / "d"
    _store(path)
    (path / "index.lmdb" / "data.mdb").write_bytes(payloads["pickle"] * 200)
    with tripwires(), pytest.raises((DiskIndexUnreadable, NotADiskStore)):
        DiskStore(path, GEO)


# -- snapshot, trace, config, events, metrics --------------------------------------------------

def test_other_readers_reject_crafted_bytes(tmp_path, payloads):
    for kind, data in payloads.items():
        f = tmp_path / f"input-{kind}"
        f.write_bytes(data)
        with tripwires():
            assert read_snapshot(f) is None
            with pytest.raises(ConfigError, match="no readable kvtier stats snapshot"):
                collect_stats(None, None, snapshot_path=f)
            with pytest.raises(TraceError, match=str(f)):
                load_trace(f)
            with pytest.raises(ConfigError, match=str(f)):
                load_config(f, env={})
            with pytest.raises(DecodeError):
                decode_batch(data)
            with pytest.raises(DecodeError):
                decode_gap(data)
            try:
                assert parse_metrics(data.decode("utf-8", "replace")) == {}
            except ScrapeError:
                pass


def test_snapshot_files_are_private_and_round_trip(tmp_path):
    old = os.umask(0)
    try:
        p = tmp_path / "kvtier-stats.json"
        write_snapshot(p, {"manager": {"lookups": 3}})
    finally:
        os.umask(old)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert read_snapshot(p)["manager"] == {"lookups": 3}


# -- nothing in the package can deserialize code ---------------------------------------------

_FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve",
                      "joblib"}
_FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
_FORBIDDEN_ATTRS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"),
                    ("yaml", "full_load"), ("np", "load"), ("numpy", "load"),
                    ("importlib", "import_module")}


def test_package_never_imports_or_calls_a_deserializer_of_code():
    found = []
    for path in Path(kvtier.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(Path(kvtier.__file__).parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [where for a in node.names if a.name.split(".")[0] in _FORBIDDEN_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] in _FORBIDDEN_MODULES:
                    found.append(where)
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name) and f.id in _FORBIDDEN_CALLS:
                    found.append(f"{where} {f.id}()")
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and \
                        (f.value.id, f.attr) in _FORBIDDEN_ATTRS:
                    found.append(f"{where} {f.value.id}.{f.attr}()")
    assert found == []


# -- directories: private, ours, no links ------------------------------------------------------

def test_store_is_private_even_under_umask_zero(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "d"
        with DiskStore(path, GEO, segment_bytes=2 * REC) as s:
            s.put_many([(key(i), block(key(i))) for i in range(5)])
    finally:
        os.umask(old)
    dirs = [path, path / "segments", path / "index.lmdb"]
    files = [p for p in path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"data.mdb", "lock.mdb", "00000001.seg"}
    assert {stat.S_IMODE(d.stat().st_mode) for d in dirs} == {0o700}
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}


def test_world_writable_directory_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o777)
    with pytest.raises(UnsafeDiskDirectory, match="world-writable.*chmod 700"):
        DiskStore(empty, GEO)
    assert os.listdir(empty) == []  # refused before writing anything
    used = tmp_path / "used"
    _store(used)
    os.chmod(used / "index.lmdb", 0o757)
    with pytest.raises(UnsafeDiskDirectory, match="index.lmdb is world-writable"):
        DiskStore(used, GEO)
    os.chmod(used / "index.lmdb", 0o700)
    os.chmod(used, 0o703)
    with pytest.raises(UnsafeDiskDirectory, match="world-writable"):
        DiskStore(used, GEO)
    os.chmod(used, 0o700)
    with DiskStore(used, GEO, segment_bytes=3 * REC) as s:  # fixed: accepted again
        assert s.get(key(0)) == block(key(0))


def test_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
    else:
        other = Path("/")  # owned by root, never by this user
    with pytest.raises(UnsafeDiskDirectory, match=r"owned by uid \d+, not by this process"):
        DiskStore(other, GEO)


def test_symlinked_subdirectory_is_refused(tmp_path):
    path = tmp_path / "d"
    _store(path)
    elsewhere = tmp_path / "elsewhere"
    (path / "segments").rename(elsewhere)
    (path / "segments").symlink_to(elsewhere)
    with pytest.raises(UnsafeDiskDirectory, match="symbolic link"):
        DiskStore(path, GEO)


def test_cli_reports_an_unsafe_directory_in_one_line(tmp_path):
    bad = tmp_path / "shared"
    bad.mkdir()
    os.chmod(bad, 0o777)
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text(f"tiers:\n  cpu: {{capacity: 4MiB}}\n  disk: {{path: {bad}, capacity: 64MiB}}\n")
    r = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "--config", str(cfg),
                        "--limit", "5"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "world-writable" in r.stderr and "Traceback" not in r.stderr


# -- fuzzing the text inputs -------------------------------------------------------------------

_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(data=st.binary(max_size=400) | st.lists(_JSONISH.map(json.dumps), max_size=5).map(
    lambda lines: "\n".join(lines).encode()))
def test_trace_files_of_any_bytes_load_or_raise_trace_error(tmp_path, data):
    f = tmp_path / "t.jsonl"
    f.write_bytes(data)
    try:
        reqs = load_trace(f)
    except TraceError as err:
        assert str(f) in str(err)
        return
    assert reqs and all(r.input_length >= 1 and r.hash_ids for r in reqs)


def test_deeply_nested_trace_line_is_a_trace_error():
    with pytest.raises(TraceError):
        parse_line("[" * 100_000, "deep:1")


@pytest.mark.parametrize("ts", ["NaN", "Infinity"])
def test_non_finite_trace_timestamp_is_refused(ts):
    line = f'{{"timestamp": {ts}, "input_length": 10, "output_length": 1, "hash_ids": [1]}}'
    try:
        req = parse_line(line, "t:1")
    except TraceError:
        return
    assert math.isfinite(req.timestamp)


@FUZZ
@given(data=st.binary(max_size=300))
def test_config_files_of_any_bytes_load_or_raise_config_error(tmp_path, monkeypatch, data):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "kvtier.yaml"
    f.write_bytes(data)
    try:
        assert isinstance(load_config(f, env={}), KvtierConfig)
    except ConfigError as err:
        assert str(err).startswith(str(f))


@FUZZ
@given(env=st.dictionaries(st.sampled_from(sorted(ENV_OVERRIDES)),
                           st.text(max_size=12) | st.sampled_from(["1GiB", "-1", "zstd", "arc",
                                                                   "true", "0.5", "nan", "1e400"]),
                           max_size=4))
def test_environment_overrides_load_or_name_the_variable(tmp_path, monkeypatch, env):
    monkeypatch.chdir(tmp_path)
    try:
        assert isinstance(load_config(env=env), KvtierConfig)
    except ConfigError as err:
        assert err.key in env, (err.key, env)


def test_deeply_nested_config_is_a_config_error():
    for text in ["[" * 50_000, "a: " + "{a: " * 20_000, "- " * 5000 + "x"]:
        with pytest.raises(ConfigError):
            load_config(text=text, env={})


@FUZZ
@given(snap=st.dictionaries(st.sampled_from(["manager", "usage", "transfers", "requests", "disk",
                                             "pid", "written_at", "events"]), _JSONISH, max_size=5))
def test_stats_snapshot_of_any_json_is_shown_or_refused(tmp_path, snap):
    f = tmp_path / "kvtier-stats.json"
    f.write_text(json.dumps({"format": 1, **snap}))
    try:
        data = collect_stats(None, None, snapshot_path=f)
    except ConfigError:
        return
    print_stats(data, Console(file=io.StringIO()))
