"""DiskStore: round trips, persistence, identity checks, corruption, reclamation, threads."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import random
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.tiers.disk import (
    DiskIndexUnreadable,
    DiskLayoutMismatch,
    DiskStore,
    DiskStoreBusy,
    DiskWriteError,
    NotADiskStore,
)
from kvtier.tiers.disk import segments as segments_mod
from kvtier.tiers.disk.catalog.index import IndexWriter
from kvtier.tiers.record import CODEC_NONE, CODEC_ZSTD, HEADER_BYTES
from kvtier.tiers.layout import BlockGeometry

GEO = BlockGeometry(num_layers=2, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024,
                    model="test-model")
BB = GEO.block_bytes  # 4 KiB
KEY_LEN = 16
REC = HEADER_BYTES + KEY_LEN + BB  # one uncompressed record


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=KEY_LEN).digest()


def payload(k: bytes, compressible: bool = False) -> bytes:
    """Bytes derived from the key, so any read can be checked against the key alone."""
    if compressible:  # bf16-like: a few repeating exponent bytes, random mantissas
        rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
        vals = torch.from_numpy(rng.standard_normal(BB // 2).astype(np.float32))
        return vals.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return hashlib.shake_256(k).digest(BB)


def counted_failures(s: DiskStore) -> int:
    st = s.stats()
    return st.checksum_failures + st.read_errors


def entry_of(s: DiskStore, k: bytes):
    e = s._index.get(k)
    assert e is not None
    return e


def seg_path(s: DiskStore, seg: int) -> Path:
    return s.root / "segments" / f"{seg:08d}.seg"


@pytest.fixture
def store(tmp_path):
    with DiskStore(tmp_path / "disk", GEO) as s:
        yield s


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_round_trip(tmp_path, compression):
    keys = [key(i) for i in range(24)]
    with DiskStore(tmp_path / "d", GEO, compression=compression) as s:
        s.put_many([(k, payload(k, compressible=True)) for k in keys[:16]])
        s.put_many([(k, memoryview(bytearray(payload(k, True)))) for k in keys[16:]])
        for k in keys:
            assert s.contains(k)
            assert s.get(k) == payload(k, True)
            slot = torch.empty(BB, dtype=torch.uint8)
            assert s.get_into(k, memoryview(slot.numpy()))
            assert slot.numpy().tobytes() == payload(k, True)
        assert s.get(key(999)) is None and not s.contains(key(999))
        assert not s.get_into(key(999), memoryview(bytearray(BB)))
        st = s.stats()
        assert st.num_blocks == 24 and st.logical_bytes == 24 * BB
        codecs = {entry_of(s, k).codec for k in keys}
        if compression == "zstd":
            assert codecs == {CODEC_ZSTD} and st.compression_ratio > 1.1
        else:
            assert codecs == {CODEC_NONE} and st.compression_ratio < 1.0  # headers + keys
        assert counted_failures(s) == 0


def test_incompressible_block_is_stored_raw(tmp_path):
    with DiskStore(tmp_path / "d", GEO, compression="zstd") as s:
        s.put_many([(key(1), payload(key(1)))])
        assert entry_of(s, key(1)).codec == CODEC_NONE
        assert s.get(key(1)) == payload(key(1))


def test_bad_input_is_refused(store):
    with pytest.raises(ValueError, match=str(BB)):
        store.put_many([(key(1), b"x" * (BB - 1))])
    with pytest.raises(ValueError):
        store.put_many([(key(2), payload(key(2))), (b"", payload(key(3)))])
    with pytest.raises(ValueError):
        store.put_many([(b"k" * 600, payload(key(3)))])
    assert store.stats().num_blocks == 0  # a bad item anywhere rejects the whole batch
    with pytest.raises(ValueError):
        store.get_into(key(1), memoryview(bytearray(BB - 8)))
    with pytest.raises(ValueError):
        DiskStore(store.root.parent / "other", GEO, compression="lz4")


def test_reopen_restores_everything(tmp_path):
    path = tmp_path / "d"
    keys = [key(i) for i in range(10)]
    with DiskStore(path, GEO, compression="zstd", segment_bytes=4 * REC) as s:
        for k in keys:
            s.put_many([(k, payload(k, True))])
        s.put_many([(keys[0], payload(keys[0], True))])  # rewrite: now the youngest
        s.delete_many([keys[5]])
        before = s.stats()
    with DiskStore(path, GEO, segment_bytes=4 * REC) as s:
        expect = keys[1:5] + keys[6:] + [keys[0]]
        assert s.keys_by_age() == expect
        for k in expect:
            assert s.get(k) == payload(k, True)
        assert s.get(keys[5]) is None
        after = s.stats()
        assert (after.num_blocks, after.stored_bytes) == (before.num_blocks, before.stored_bytes)
        s.put_many([(key(100), payload(key(100)))])
        assert s.keys_by_age()[-1] == key(100)
    assert DiskStore.read_stats(path).num_blocks == 10


def test_unindexed_tail_is_cut_on_open(tmp_path):
    path = tmp_path / "d"
    with DiskStore(path, GEO) as s:
        s.put_many([(key(1), payload(key(1)))])
        active = s._files.active_id
    with open(seg_path(s, active), "ab") as f:  # a crash between append and index commit
        f.write(b"\x00" * 1000)
    with DiskStore(path, GEO) as s:
        assert os.path.getsize(seg_path(s, active)) == REC
        s.put_many([(key(2), payload(key(2)))])
        assert s.get(key(1)) == payload(key(1)) and s.get(key(2)) == payload(key(2))


def test_other_geometry_is_refused(tmp_path):
    path = tmp_path / "d"
    with DiskStore(path, GEO) as s:
        s.put_many([(key(1), payload(key(1)))])
    other = BlockGeometry(num_layers=4, kv_parts=2, engine_blocks_per_block=1, page_bytes=1024)
    with pytest.raises(DiskLayoutMismatch) as info:
        DiskStore(path, other)
    msg = str(info.value)
    assert GEO.describe() in msg and other.describe() in msg and "delete" in msg
    assert isinstance(info.value, ValueError)
    with DiskStore(path, GEO) as s:  # the refusal left the directory intact and unlocked
        assert s.get(key(1)) == payload(key(1))


def test_foreign_directory_and_double_open_are_refused(tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    with pytest.raises(NotADiskStore):
        DiskStore(foreign, GEO)
    assert (foreign / "notes.txt").read_text() == "precious"
    with pytest.raises(NotADiskStore):
        DiskStore.read_stats(foreign)
    with DiskStore(tmp_path / "d", GEO):
        with pytest.raises(DiskStoreBusy):
            DiskStore(tmp_path / "d", GEO)
        with pytest.raises(DiskStoreBusy, match="stats"):
            DiskStore.read_stats(tmp_path / "d")


def test_permissions(tmp_path):
    path = tmp_path / "d"
    with DiskStore(path, GEO, segment_bytes=2 * REC) as s:
        s.put_many([(key(i), payload(key(i))) for i in range(5)])
    dirs = [path, path / "segments", path / "index.lmdb"]
    files = [p for p in path.rglob("*") if p.is_file()]
    assert len([p for p in files if p.suffix == ".seg"]) >= 2
    for d in dirs:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


# -- corruption: each case must read as a miss, be counted once and drop the entry --------

def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _corrupt_payload(s, k, other):
    e = entry_of(s, k)
    _flip(seg_path(s, e.segment), e.offset + e.length - 7)


def _corrupt_header(s, k, other):
    e = entry_of(s, k)
    _flip(seg_path(s, e.segment), e.offset + 20)  # inside the sequence number


def _truncate_segment(s, k, other):
    e = entry_of(s, k)
    os.truncate(seg_path(s, e.segment), e.offset + e.length - 100)


def _overwrite_with_other_record(s, k, other):
    e, o = entry_of(s, k), entry_of(s, other)
    assert e.length == o.length
    with open(seg_path(s, o.segment), "rb") as f:
        f.seek(o.offset)
        rec = f.read(o.length)
    with open(seg_path(s, e.segment), "r+b") as f:
        f.seek(e.offset)
        f.write(rec)


def _index_past_end(s, k, other):
    e = entry_of(s, k)
    size = os.path.getsize(seg_path(s, e.segment))
    with IndexWriter(s._index) as w:
        w.put(k, e._replace(offset=size + 4096))


def _delete_segment(s, k, other):
    e = entry_of(s, k)
    assert e.segment != s._files.active_id  # a sealed segment, as after a lost file
    os.unlink(seg_path(s, e.segment))


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_payload, _corrupt_header, _truncate_segment, _overwrite_with_other_record,
     _index_past_end, _delete_segment],
)
def test_corruption_is_a_counted_miss(tmp_path, corrupt, compression):
    with DiskStore(tmp_path / "d", GEO, compression=compression, segment_bytes=3 * REC) as s:
        keys = [key(i) for i in range(7)]
        s.put_many([(k, payload(k)) for k in keys])  # incompressible: equal record lengths
        victim, other = keys[2], keys[1]  # the victim ends the first (sealed) segment
        corrupt(s, victim, other)
        before = counted_failures(s)
        out = bytearray(BB)
        assert s.get_into(victim, memoryview(out)) is False
        assert counted_failures(s) == before + 1
        assert not s.contains(victim)
        assert s.get(victim) is None
        assert counted_failures(s) == before + 1  # the dropped entry is now a plain miss
        for k in keys[3:]:  # other segments are untouched
            assert s.get(k) == payload(k)
        if corrupt not in (_delete_segment,):
            assert s.get(keys[0]) == payload(keys[0])


def test_garbage_index_value_is_a_miss(store):
    store.put_many([(key(1), payload(key(1)))])
    with IndexWriter(store._index) as w:
        w.txn.put(key(1), b"\x07junk", db=store._index.blocks)
    assert store.get(key(1)) is None


# -- deletes and space reclamation ---------------------------------------------------------

def test_delete_unlinks_empty_segments(tmp_path):
    with DiskStore(tmp_path / "d", GEO, segment_bytes=3 * REC) as s:
        keys = [key(i) for i in range(12)]
        s.put_many([(k, payload(k)) for k in keys])
        first = entry_of(s, keys[0]).segment
        size0 = s.stats().file_bytes
        assert s.delete_many(keys[:3] + [key(500)]) == 3
        assert not seg_path(s, first).exists()
        st = s.stats()
        assert st.file_bytes == size0 - 3 * REC and st.reclaimed_bytes == 3 * REC
        assert st.num_blocks == 9
        for k in keys[3:]:
            assert s.get(k) == payload(k)


@pytest.mark.parametrize("inline", [True, False])
def test_compaction_keeps_survivors(tmp_path, inline):
    budget = 1 << 30 if inline else 0  # 0: deletes never compact, compact() does it all
    with DiskStore(tmp_path / "d", GEO, segment_bytes=4 * REC, compression="zstd",
                   compact_budget_bytes=budget) as s:
        keys = [key(i) for i in range(32)]
        s.put_many([(k, payload(k, compressible=i % 2 == 0)) for i, k in enumerate(keys)])
        segs_before = {entry_of(s, k).segment for k in keys}
        size0 = s.stats().file_bytes
        survivors = keys[::4]  # 3 of every 4 records die: every sealed segment is mostly dead
        s.delete_many([k for k in keys if k not in survivors])
        reclaimed = s.compact()
        if inline:
            assert reclaimed == 0  # already done by the deletes
        else:
            assert reclaimed > 0
        st = s.stats()
        assert st.file_bytes < size0 / 2
        assert st.reclaimed_bytes >= size0 / 2
        assert {entry_of(s, k).segment for k in survivors}.isdisjoint(segs_before - {
            s._files.active_id})
        assert s.keys_by_age() == survivors  # copying kept the age order
        for i, k in zip(range(0, 32, 4), survivors):
            assert s.get(k) == payload(k, compressible=i % 2 == 0)
        assert counted_failures(s) == 0
    with DiskStore(tmp_path / "d", GEO, segment_bytes=4 * REC) as s:
        assert sorted(s.keys_by_age()) == sorted(survivors)
        assert all(s.get(k) is not None for k in survivors)


def test_overwrite_makes_old_record_dead(store):
    store.put_many([(key(i), payload(key(i))) for i in range(3)])
    store.put_many([(key(0), payload(key(0)))])
    assert store.keys_by_age() == [key(1), key(2), key(0)]
    st = store.stats()
    assert st.num_blocks == 3 and st.stored_bytes == 3 * REC and st.file_bytes == 4 * REC


# -- write failures ------------------------------------------------------------------------

def test_enospc_rolls_back_and_store_stays_usable(store, monkeypatch):
    store.put_many([(key(1), payload(key(1)))])
    real = os.pwritev
    calls = {"n": 0}

    def failing(fd, bufs, offset):
        calls["n"] += 1
        if calls["n"] == 1:
            return real(fd, [memoryview(bufs[0])[:10]], offset)  # a torn, partial write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segments_mod.os, "pwritev", failing)
    with pytest.raises(DiskWriteError) as info:
        store.put_many([(key(i), payload(key(i))) for i in range(2, 6)])
    monkeypatch.setattr(segments_mod.os, "pwritev", real)
    assert info.value.errno == errno.ENOSPC and "ENOSPC" in str(info.value)
    assert not any(store.contains(key(i)) for i in range(2, 6))
    assert store.stats().write_errors == 1
    assert os.path.getsize(seg_path(store, store._files.active_id)) == REC  # tail cut off
    store.put_many([(key(7), payload(key(7)))])
    assert store.get(key(1)) == payload(key(1)) and store.get(key(7)) == payload(key(7))


def test_fsync_failure_indexes_nothing(store, monkeypatch):
    def eio(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(segments_mod.os, "fdatasync", eio)
    with pytest.raises(DiskWriteError):
        store.put_many([(key(1), payload(key(1)))])
    monkeypatch.undo()
    assert not store.contains(key(1))
    store.put_many([(key(2), payload(key(2)))])
    assert store.get(key(2)) == payload(key(2))


# -- threads -------------------------------------------------------------------------------

def test_threads_never_see_wrong_bytes(tmp_path):
    """Writers, readers and deleters race (with compaction); every hit must be exact."""
    universe = [key(i) for i in range(64)]
    errors: list[str] = []
    stop = threading.Event()
    with DiskStore(tmp_path / "d", GEO, segment_bytes=6 * REC, fsync=False,
                   compression="zstd") as s:

        def writer(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                ks = rng.sample(universe, 4)
                s.put_many([(k, payload(k, compressible=k[0] % 2 == 0)) for k in ks])

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            buf = bytearray(BB)
            while not stop.is_set():
                k = rng.choice(universe)
                if s.get_into(k, memoryview(buf)) and bytes(buf) != payload(k, k[0] % 2 == 0):
                    errors.append(k.hex())

        def deleter(seed: int) -> None:
            rng = random.Random(seed)
            while not stop.is_set():
                s.delete_many(rng.sample(universe, 6))

        threads = [threading.Thread(target=f, args=(i,)) for i, f in
                   enumerate([writer, writer, reader, reader, reader, deleter])]
        for t in threads:
            t.start()
        timer = threading.Timer(2.0, stop.set)
        timer.start()
        for t in threads:
            t.join()
        assert not errors
        st = s.stats()
        assert st.checksum_failures == 0 and st.read_errors == 0  # races are not corruption
        assert st.reclaimed_bytes > 0
        for k in s.keys_by_age():
            assert s.get(k) == payload(k, k[0] % 2 == 0)


def test_threads_lose_no_acknowledged_block(tmp_path):
    """Concurrent writers (merged into pipelined groups) plus churn that forces rotation and
    compaction: every block whose put_many returned and was not deleted must read back."""
    owned = [[key(1000 * w + i) for i in range(40)] for w in range(4)]
    churn = [key(9000 + i) for i in range(40)]
    with DiskStore(tmp_path / "d", GEO, segment_bytes=5 * REC, fsync=True,
                   compact_budget_bytes=8 * REC) as s:

        def writer(keys: list[bytes]) -> None:
            rng = random.Random(keys[0])
            for i in range(0, len(keys), 3):
                s.put_many([(k, payload(k)) for k in keys[i : i + 3]])
                again = rng.sample(keys[: i + 3], 2)  # overwrites leave dead bytes behind
                s.put_many([(k, payload(k)) for k in again])

        def churner() -> None:
            rng = random.Random(7)
            for _ in range(60):
                ks = rng.sample(churn, 5)
                s.put_many([(k, payload(k)) for k in ks])
                s.delete_many(rng.sample(churn, 8))

        threads = [threading.Thread(target=writer, args=(ks,)) for ks in owned]
        threads.append(threading.Thread(target=churner))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        st = s.stats()
        assert st.checksum_failures == 0 and st.read_errors == 0
        assert st.reclaimed_bytes > 0
        for ks in owned:
            for k in ks:
                assert s.get(k) == payload(k), k.hex()
        live = set(s.keys_by_age())
        assert set(k for ks in owned for k in ks) <= live
        assert st.num_blocks == len(live)
    with DiskStore(tmp_path / "d", GEO, segment_bytes=5 * REC) as s:
        assert all(s.get(k) == payload(k) for ks in owned for k in ks)


def test_sealed_segment_with_uncommitted_records_is_not_removed(tmp_path):
    """A group's records can sit in a just-sealed segment while an earlier group's commit
    (and its empty-segment sweep) runs; the sweep must not unlink that segment."""
    from kvtier.tiers.disk.catalog.index import IndexEntry
    from kvtier.tiers.record import encode_head
    from kvtier.tiers.disk.writer import LAYOUT_VERSION

    with DiskStore(tmp_path / "d", GEO, segment_bytes=3 * REC) as s:
        w = s._writer
        s.put_many([(key(1), payload(key(1)))])  # committed, segment A
        first = entry_of(s, key(1)).segment

        def records(ks, seq0):
            out = []
            for i, k in enumerate(ks):
                _k, codec, stored, csum, length = w.prepare(k, payload(k))
                head = encode_head(k, codec=codec, layout_version=LAYOUT_VERSION, seq=seq0 + i,
                                   raw_len=BB, stored_len=len(stored), checksum=csum)
                out.append(([head, stored], length))
            return out

        ks = [key(2), key(3), key(4)]
        seq0 = w.next_seq
        w.next_seq += 3
        places, sealed = w.append(records(ks, seq0))  # two land in A, then A is sealed
        assert sealed == {first} and places[0][0] == first
        assert s.delete_many([key(1)]) == 1  # A now shows no live record in the index
        assert seg_path(s, first).exists()

        def publish(ix):
            for i, (k, (seg, off)) in enumerate(zip(ks, places)):
                ix.put(k, IndexEntry(seg, off, REC, w.prepare(k, payload(k))[3], CODEC_NONE,
                                     LAYOUT_VERSION, seq0 + i, BB, 0.0))

        w.commit(publish, "test")
        w.settle(sealed)
        for k in ks:
            assert s.get(k) == payload(k)
        assert counted_failures(s) == 0


def test_damaged_index_is_a_clear_error(tmp_path):
    path = tmp_path / "d"
    with DiskStore(path, GEO) as s:
        s.put_many([(key(1), payload(key(1)))])
    data = path / "index.lmdb" / "data.mdb"
    data.write_bytes(b"\xff" * data.stat().st_size)  # meta pages destroyed
    with pytest.raises(DiskIndexUnreadable, match="delete"):
        DiskStore(path, GEO)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # the failed open released the lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    with pytest.raises((NotADiskStore, DiskIndexUnreadable), match=str(path)):
        DiskStore.read_stats(path)


def test_read_racing_compaction_retries_instead_of_failing(tmp_path, monkeypatch):
    import kvtier.tiers.disk.store as store_mod

    with DiskStore(tmp_path / "d", GEO, segment_bytes=4 * REC, compact_budget_bytes=0) as s:
        keys = [key(i) for i in range(8)]
        s.put_many([(k, payload(k)) for k in keys])
        s.delete_many(keys[1:4])  # the first segment is now 1/4 live: a compaction candidate
        victim = keys[0]
        old = entry_of(s, victim)
        real = store_mod.read_into
        seen = []

        def racing(files, codec, k, entry, out, layout_version):
            if not seen:  # compaction moves the block and unlinks its segment mid-read
                seen.append(entry)
                assert s.compact() > 0
            return real(files, codec, k, entry, out, layout_version)

        monkeypatch.setattr(store_mod, "read_into", racing)
        assert s.get(victim) == payload(victim)
        assert seen == [old] and entry_of(s, victim).segment != old.segment
        assert not seg_path(s, old.segment).exists()
        assert counted_failures(s) == 0 and s.contains(victim)

