"""A replicated (MLA) KV layout is written to disk once, by rank 0; rank 1 reads rank 0's
records through a read-only path (tiers/disk/replica.py, tiers/disk/io/replicated.py).

Rank 1 runs in its own process (tests/tiers/disk/replica_child.py), as vLLM runs each TP rank, against
rank 0's store opened here. Before the change every rank wrote its own copy of every block
(``<path>/rank<r>``), so an MLA cache took world_size x the bytes on disk.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import select
import subprocess
import sys
from itertools import count
from pathlib import Path

import pytest
import torch

from support.disk_records import holds
from reliability.corrupt import flip_payload
from replica_common import (BLOCK, DISK_BLOCKS, PAGE, geometry, pattern,
                            rank_config, view_for)

from kvtier.config import load_config
from kvtier.tiers.disk.catalog.inventory import restored_keys
from kvtier.connectors.vllm.settings import ConnectorSettings
from kvtier.manager.factory import build_manager
from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.runtime.worker import WorkerRuntime
from kvtier.tiers.disk import DiskStore, host
from kvtier.tiers.record import HEADER_BYTES
from support.promotions import is_promotion  # noqa: E402

CHILD = Path(__file__).resolve().parent / "replica_child.py"
HANG_S = 300


def key(i: int) -> bytes:
    return f"mla-block-{i:04d}".encode()


class Rank1:
    """The rank-1 worker process; every command answers one JSON line."""

    def __init__(self, root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(CHILD), str(root)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.read() == {"ready": True}

    def read(self) -> dict:
        # a hang guard, not a speed check: rank 1 blocked (say, on a lock) fails the test
        ready, _, _ = select.select([self.proc.stdout], [], [], HANG_S)
        assert ready, f"rank 1 did not answer within {HANG_S} s"
        line = self.proc.stdout.readline()
        assert line, f"rank 1 exited (code {self.proc.poll()})"
        return json.loads(line)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def __call__(self, cmd: str, keys: list[bytes] = ()) -> dict:
        self.send(f"{cmd} {','.join(k.hex() for k in keys)}")
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")
            self.proc.wait(timeout=60)
        assert self.proc.returncode == 0


@pytest.fixture
def rank1(tmp_path):
    procs = []

    def start(root: Path) -> Rank1:
        procs.append(Rank1(root))
        return procs[-1]

    yield start
    for p in procs:
        if p.proc.poll() is None:
            p.proc.kill()  # by its own handle: this test's process only
            p.proc.wait()


def rank0_runtime(root: Path) -> WorkerRuntime:
    return WorkerRuntime.create(rank_config(root, 0), view_for(geometry(0)), geometry(0),
                                rank=0, world_size=2, rank0_geometry=geometry(0),
                                replicated=True, rank0_disk=root / "rank0")


def demote(rt: WorkerRuntime, keys: list[bytes]) -> None:
    for s, k in enumerate(keys):
        rt.pool.slot(s).copy_(torch.frombuffer(bytearray(pattern(k)), dtype=torch.uint8))
    [r] = rt.engine.wait([rt.engine.submit(LoadStoreSpec.cpu(range(len(keys))),
                                           LoadStoreSpec.disk(keys))])
    assert r.ok


def segment_bytes_on_disk(root: Path) -> int:
    seg = root / "segments"
    return sum(p.stat().st_size for p in seg.iterdir()) if seg.is_dir() else 0


def holds_nothing(d: Path) -> bool:
    """(the config loader creates the configured directory, empty)"""
    return not d.exists() or not any(d.iterdir())


def record_bytes(k: bytes) -> int:
    return HEADER_BYTES + len(k) + BLOCK


def test_replicated_blocks_are_written_once_and_rank1_reads_rank0s_bytes(tmp_path, rank1):
    rt0 = rank0_runtime(tmp_path)
    try:
        r1 = rank1(tmp_path)
        keys = [key(i) for i in range(5)]
        demote(rt0, keys)
        assert r1("demote", keys)["ok"]  # done, writing nothing: rank 0 holds the one copy
        assert r1("mode") == {"mode": "replica"}
        assert rt0.store.stats().num_blocks == 5
        assert segment_bytes_on_disk(tmp_path / "rank0") == sum(map(record_bytes, keys))
        assert holds_nothing(tmp_path / "rank1")  # no second copy
        got = r1("load", keys)
        assert got["ok"] and got["equal"] == [True] * 5  # rank 0's records, byte for byte
        assert r1("drop", keys[:1])["ok"]  # rank 0 deletes the one copy, not rank 1
        assert holds(rt0.store, keys[0])
    finally:
        rt0.close()
    r1.close()


def _snapshot(root: Path) -> dict:
    """What a writer would change: names and mtimes of the directories, the index bytes."""
    out = {}
    for d in (root, root / "index.lmdb", root / "segments"):
        out[str(d)] = (d.stat().st_mtime_ns, sorted(os.listdir(d)))
    data = root / "index.lmdb" / "data.mdb"
    out["data.mdb"] = (data.stat().st_mtime_ns, hashlib.sha256(data.read_bytes()).hexdigest())
    for p in (root / "segments").iterdir():
        out[p.name] = (p.stat().st_mtime_ns, p.stat().st_size)
    return out


def test_rank1_never_writes_drops_or_locks_rank0s_store(tmp_path, rank1):
    rt0 = rank0_runtime(tmp_path)
    keys = [key(i) for i in range(4)]
    demote(rt0, keys)
    flip_payload(rt0.store, keys[1], None)  # a record rank 1 will find bad
    root = tmp_path / "rank0"
    before = _snapshot(root)
    r1 = rank1(tmp_path)
    got = r1("load", keys)
    assert got["failed"] == [keys[1].hex()] and got["transient"] == []  # a miss, not a drop
    assert got["equal"][0] and got["equal"][2:] == [True, True]
    assert _snapshot(root) == before  # no drop, no counter, no file, no segment
    assert holds(rt0.store, keys[1])  # left for rank 0 (the scheduler deletes it on all)
    assert rt0.store.stats().checksum_failures == 0
    rt0.close()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:  # rank 1 (still open, index mapped) holds no lock on the directory
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    with DiskStore(root, geometry(0), fsync=False) as again:  # rank 0 restarts beside it
        again.put_many([(key(9), pattern(key(9)))])
        got = r1("load", [keys[0], key(9)])
        assert got["ok"] and got["equal"] == [True, True]
        r1.close()
        assert again.contains(keys[1]) and again.stats().checksum_failures == 0


def _move_by_compaction(store: DiskStore, k: bytes, fillers) -> None:
    """Seal ``k``'s segment, delete its other records, compact: ``k`` moves to another
    segment and its old segment file is removed (as rank 0 does on its own)."""
    seg = store._index.get(k).segment
    while store._files.active_id == seg:
        f = next(fillers)
        store.put_many([(f, pattern(f))])
    with store._index.read() as v:
        others = [o for _, o in v.live_in_segment(seg) if o != k]
    store.delete_many(others)
    assert store.compact() > 0
    assert store._index.get(k).segment != seg and seg not in store._files.on_disk()


def test_a_read_racing_compaction_rereads_or_is_transient_never_wrong(tmp_path, rank1):
    root = tmp_path / "rank0"
    rec = record_bytes(key(0))
    store = DiskStore(root, geometry(0), fsync=False, segment_bytes=2 * rec,
                      compact_threshold=0.9, compact_budget_bytes=0)
    fillers = (f"filler-{i:06d}".encode() for i in count())
    try:
        k = key(0)
        store.put_many([(k, pattern(k))])
        r1 = rank1(tmp_path)
        assert r1("pause")["ok"]
        # once: rank 1 read the entry, the segment is compacted away before its read
        r1.send(f"load {k.hex()}")
        assert "paused" in r1.read()
        _move_by_compaction(store, k, fillers)
        r1.send("go")
        assert "paused" in r1.read()  # the old segment is gone: rank 1 looks the key up again
        r1.send("go")
        got = r1.read()
        assert got["ok"] and got["equal"] == [True]
        _move_by_compaction(store, k, fillers)  # to a segment rank 1 never opened
        # every time: the record keeps moving under the read -> a transient miss
        r1.send(f"load {k.hex()}")
        for _ in range(4):
            assert "paused" in r1.read()
            _move_by_compaction(store, k, fillers)
            r1.send("go")
        got = r1.read()
        assert got["failed"] == got["transient"] == [k.hex()] and got["equal"] == [False]
        assert r1("unpause")["ok"]
        got = r1("load", [k])
        assert got["ok"] and got["equal"] == [True]
        st = store.stats()
        assert st.checksum_failures == 0 and st.read_errors == 0 and store.contains(k)
        r1.close()
    finally:
        store.close()


def _deleted_segments_open(pid: int) -> int:
    """Segment files ``pid`` holds open that were unlinked (their space is still in use)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        n += "/segments/" in target and target.endswith("(deleted)")
    return n


def test_rank1_keeps_no_space_of_segments_rank0_removed(tmp_path, rank1):
    """Rank 0 cannot tell rank 1 that it removed a segment: every descriptor rank 1 kept on a
    removed file would keep its space allocated. At most one stays open."""
    root = tmp_path / "rank0"
    keys = [key(i) for i in range(6)]
    store = DiskStore(root, geometry(0), fsync=False, segment_bytes=record_bytes(keys[0]) + 1,
                      compact_budget_bytes=0)
    try:
        for k in keys:  # one segment each
            store.put_many([(k, pattern(k))])
        assert len(store._files.on_disk()) >= len(keys)
        r1 = rank1(tmp_path)
        got = r1("load", keys)
        assert got["ok"] and got["equal"] == [True] * len(keys)
        segs = {store._index.get(k).segment for k in keys}
        store.delete_many(keys)  # their sealed segments are empty now: removed
        assert len(segs - set(store._files.on_disk())) >= len(keys) - 1
        assert _deleted_segments_open(r1.proc.pid) <= 1
        r1.close()
    finally:
        store.close()


def test_rank0_on_another_host_falls_back_to_per_rank_copies(tmp_path, rank1):
    rt0 = rank0_runtime(tmp_path)
    try:
        keys = [key(i) for i in range(3)]
        demote(rt0, keys)
        # rank 0 of this directory serves it from another node (a shared file system)
        (tmp_path / "rank0" / host.HOST_FILE).write_text("other-node/0000")
        r1 = rank1(tmp_path)
        assert r1("load", keys)["failed"] == [k.hex() for k in keys]  # its own, empty copy
        assert r1("mode") == {"mode": "own"}
        assert r1("demote", keys)["ok"]
        got = r1("load", keys)
        assert got["ok"] and got["equal"] == [True] * 3
        r1.close()
        with DiskStore(tmp_path / "rank1", geometry(1), fsync=False) as own:
            assert set(own.keys_by_age()) == set(keys)  # the per-rank layout, as before
    finally:
        rt0.close()


def test_rank1_started_before_rank0_decides_at_its_first_transfer(tmp_path):
    """vLLM starts the ranks together; rank 0's store (and its HOST record) may not exist
    when rank 1 builds its runtime. In one process, rank 1 reads through rank 0's index."""
    rt1 = WorkerRuntime.create(rank_config(tmp_path, 1), view_for(geometry(1)), geometry(1),
                               rank=1, world_size=2, rank0_geometry=geometry(0),
                               replicated=True, rank0_disk=tmp_path / "rank0")
    rt0 = rank0_runtime(tmp_path)
    try:
        assert rt1.replica is not None and rt1.replica.mode is None
        keys = [key(i) for i in range(2)]
        demote(rt0, keys)
        [r] = rt1.engine.wait([rt1.engine.submit(LoadStoreSpec.disk(keys),
                                                 LoadStoreSpec.cpu([0, 1]))])
        assert r.ok and rt1.replica.mode == "replica"
        assert [bytes(rt1.pool.slot(s).numpy()) for s in (0, 1)] == [pattern(k) for k in keys]
        assert holds_nothing(tmp_path / "rank1")
    finally:
        rt1.close()
        rt0.close()


def test_replicated_capacity_is_the_configured_capacity_and_restart_reads_rank0(tmp_path):
    """Per-rank layouts use capacity on every rank (tests/tiers/disk/test_tp_ranks.py); a replicated one
    keeps one copy, bounded by ``tiers.disk.capacity``; at restart rank 0's keys are the
    truth (a stale ``rank1`` directory of an earlier per-rank run is not read)."""
    cfg = load_config(text=f"tiers:\n  cpu: {{capacity: {4 * BLOCK}}}\n"
                           f"  disk: {{path: {tmp_path}, capacity: {DISK_BLOCKS * BLOCK}, "
                           f"fsync: false, compression: none}}\n", env={})
    settings = ConnectorSettings(config=cfg, block_size=16, hash_block_size=16,
                                 block_tokens=16, layer_names=("l0", "l1"), page_bytes=PAGE,
                                 sliding_window=None, world_size=2, tp_size=2,
                                 kv_dtype="uint8", identity="mla-test", replicated_kv=True)
    with DiskStore(settings.rank_config(1).disk.path, settings.geometry(1), fsync=False) as old:
        old.put_many([(b"stale-per-rank-block", bytes(BLOCK))])
    assert settings.disk_paths() == [tmp_path / "rank0"]
    rts = [WorkerRuntime.create(settings.rank_config(r), view_for(settings.geometry(r)),
                                settings.geometry(r), rank=r, world_size=2,
                                rank0_geometry=settings.geometry(0), replicated=True,
                                rank0_disk=settings.disk_paths()[0]) for r in range(2)]
    manager = build_manager(settings.config, settings.block_bytes)

    def run(src, dst) -> bool:  # on every rank; ok only if ok on all (the job ledger)
        return all([rt.engine.wait([rt.engine.submit(src, dst)])[0].ok for rt in rts])

    try:
        for i in range(0, 40, 4):
            plan = manager.prepare_store([key(j) for j in range(i, i + 4)])
            for rt in rts:
                for k, slot in zip(plan.keys, plan.cpu_slots):
                    rt.pool.slot(slot).copy_(torch.frombuffer(bytearray(pattern(k)),
                                                              dtype=torch.uint8))
            manager.complete_store(plan.keys, True)
            while todo := manager.take_background_transfers():
                for t in todo:
                    manager.complete_background(t.id, run(t.src, t.dst))
        capacity = settings.config.disk.capacity
        assert manager.usage()["DISK"]["capacity_blocks"] == capacity // BLOCK == DISK_BLOCKS
        st = rts[0].store.stats()
        assert st.num_blocks == DISK_BLOCKS and st.logical_bytes == capacity  # full, one copy
        on_disk = set(rts[0].store.keys_by_age())
        assert on_disk == set(manager.tier(Medium.DISK).entries)
        hit = sorted(on_disk)[:2]
        assert not any(k in manager.tier(Medium.CPU) for k in hit)  # on disk only
        found = manager.lookup(hit)  # promoted from the one copy rank 0 wrote
        assert found.pending and found.tiers == ()
        [promotion] = manager.take_background_transfers()
        assert is_promotion(promotion) and promotion.src == LoadStoreSpec.disk(hit)
        assert run(promotion.src, promotion.dst)  # every rank reads it
        for rt in rts:
            assert [bytes(rt.pool.slot(s).numpy()) for s in promotion.dst.ids] == \
                [pattern(k) for k in hit]
        manager.complete_background(promotion.id, True)
        assert manager.lookup(hit, sighting=False).tiers == (Medium.CPU, Medium.CPU)
        plan = manager.prepare_load(hit)
        assert plan.keys == tuple(hit) and plan.sources == (Medium.DISK, Medium.DISK)
        assert plan.cpu_slots == promotion.dst.ids
        manager.complete_load(plan.keys, ())
        assert manager.pins() == 0 and manager.stats.protocol_errors == 0
    finally:
        for rt in rts:
            rt.close()
    common, partial = restored_keys(settings.disk_paths(), settings.disk_geometries())
    assert set(common) == on_disk and partial == []
