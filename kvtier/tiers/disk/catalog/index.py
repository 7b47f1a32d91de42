"""The disk tier's index: an LMDB environment mapping block keys to record locations.

LMDB gives crash-safe, multi-reader/one-writer transactions, so a batch of blocks is published
with one commit and concurrent readers never see half of it. Values are ``struct``-packed
records (never pickles). Sub-databases:

- ``blocks``:   key -> :class:`IndexEntry`
- ``locs``:     (segment, offset) big-endian -> key, so compaction can walk one segment's
                live records in file order without scanning the whole index
- ``ages``:     sequence number big-endian -> key, oldest first (LRU rebuild, oldest/newest ts)
- ``segments``: segment id -> (live bytes, end offset, live records); dead = end - live
- ``meta``:     geometry fingerprint, format version, counters, id allocators
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator, NamedTuple

import lmdb

_ENTRY = struct.Struct("<BIQQQBBHQQd")
_ENTRY_VERSION = 1
_SEG = struct.Struct("<QQQ")
_LOC = struct.Struct(">IQ")
_SEQ = struct.Struct(">Q")
_U64 = struct.Struct("<Q")
MAX_READERS = 1024  # lmdb_check.LOCK_BYTES allocates this many reader slots

COUNTERS = ("checksum_failures", "read_errors", "write_errors", "reclaimed_bytes")


class IndexEntry(NamedTuple):
    segment: int
    offset: int
    length: int  # whole record: header + key + stored payload
    checksum: int  # xxh3-64 of key + stored payload (also in the record header)
    codec: int
    layout_version: int
    seq: int
    raw_len: int
    ts: float

    def pack(self) -> bytes:
        return _ENTRY.pack(
            _ENTRY_VERSION, self.segment, self.offset, self.length, self.checksum, self.codec, 0,
            self.layout_version, self.seq, self.raw_len, self.ts,
        )

    @staticmethod
    def unpack(raw: bytes) -> "IndexEntry | None":
        """``None`` for a value this code cannot read (treated as a missing entry)."""
        if len(raw) != _ENTRY.size or raw[0] != _ENTRY_VERSION:
            return None
        _v, seg, off, length, csum, codec, _pad, layout, seq, raw_len, ts = _ENTRY.unpack(raw)
        return IndexEntry(seg, off, length, csum, codec, layout, seq, raw_len, ts)


class SegmentInfo(NamedTuple):
    live_bytes: int
    end: int  # bytes of the file that are accounted for (records, live or dead)
    live_records: int


def _segment_info(raw: bytes | None) -> SegmentInfo | None:
    """``None`` for a missing or malformed value (treated as a missing segment record)."""
    if raw is None or len(raw) != _SEG.size:
        return None
    return SegmentInfo(*_SEG.unpack(raw))


class BlockIndex:
    """Thin typed wrapper over the LMDB environment; callers serialise writers themselves."""

    def __init__(
        self, path: Path, *, map_size: int, sync: bool, readonly: bool = False,
        dir_fd: int | None = None,
    ) -> None:
        """``sync``: a commit is durable when it returns, meta page included (``metasync``:
        without it a power cut can undo the last acknowledged commits). ``writemap`` stays
        off: pages are written with ``pwrite``, so a full disk is an error, never a SIGBUS.
        ``dir_fd``: the directory, already opened without following links; LMDB opens its
        files through it (``/proc/self/fd``), so a swapped path cannot redirect it."""
        where = str(path)
        if dir_fd is not None and os.path.isdir("/proc/self/fd"):
            where = f"/proc/self/fd/{dir_fd}"
        self.path = path
        self.env = lmdb.open(
            where, map_size=map_size, subdir=True, readonly=readonly, create=not readonly,
            sync=sync, metasync=sync, writemap=False, readahead=False, mode=0o600, max_dbs=8,
            max_readers=MAX_READERS,
        )
        txn = None if readonly else self.env.begin(write=True)
        try:
            self.blocks = self.env.open_db(b"blocks", txn=txn, create=not readonly)
            self.locs = self.env.open_db(b"locs", txn=txn, create=not readonly)
            self.ages = self.env.open_db(b"ages", txn=txn, create=not readonly)
            self.segments = self.env.open_db(b"segments", txn=txn, create=not readonly)
            self.meta = self.env.open_db(b"meta", txn=txn, create=not readonly)
        except BaseException:
            if txn is not None:
                txn.abort()
            self.env.close()
            raise
        if txn is not None:
            txn.commit()

    def close(self) -> None:
        self.env.close()

    # -- reads (any thread) -------------------------------------------------------------
    def get(self, key: bytes) -> IndexEntry | None:
        raw = self.get_raw(key)
        return None if raw is None else IndexEntry.unpack(raw)

    def get_raw(self, key: bytes) -> bytes | None:
        """The stored value as is (tells a damaged entry from a miss)."""
        with self.env.begin(db=self.blocks) as txn:
            return txn.get(key)

    def read(self) -> "IndexView":
        return IndexView(self, self.env.begin())


class IndexView:
    """Queries that must see one snapshot; also the base of :class:`IndexWriter`."""

    def __init__(self, index: BlockIndex, txn: lmdb.Transaction) -> None:
        self.ix = index
        self.txn = txn

    def __enter__(self) -> "IndexView":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.txn.abort()

    def entry(self, key: bytes) -> IndexEntry | None:
        raw = self.txn.get(key, db=self.ix.blocks)
        return None if raw is None else IndexEntry.unpack(raw)

    def num_blocks(self) -> int:
        return int(self.txn.stat(self.ix.blocks)["entries"])

    def meta(self, name: str) -> bytes | None:
        return self.txn.get(name.encode(), db=self.ix.meta)

    def meta_int(self, name: str) -> int:
        raw = self.meta(name)
        return _U64.unpack(raw)[0] if raw is not None and len(raw) == 8 else 0

    def segment(self, seg: int) -> SegmentInfo | None:
        return _segment_info(self.txn.get(_U64.pack(seg), db=self.ix.segments))

    def segments(self) -> dict[int, SegmentInfo]:
        """Every readable segment record; a malformed one reads as absent (its file is then
        an orphan, and entries pointing into it fail verification: misses, never wrong data)."""
        with self.txn.cursor(db=self.ix.segments) as cur:
            out = {}
            for k, v in cur:
                info = _segment_info(v)
                if info is not None and len(k) == _U64.size:
                    out[_U64.unpack(k)[0]] = info
            return out

    def keys_by_age(self) -> list[bytes]:
        """Each key once, oldest first (a damaged ``ages`` table cannot list a key twice)."""
        with self.txn.cursor(db=self.ix.ages) as cur:
            seen: dict[bytes, None] = {}
            for v in cur.iternext(keys=False, values=True):
                k = bytes(v)
                seen.pop(k, None)  # the newest age wins
                seen[k] = None
            return list(seen)

    def oldest_newest(self) -> tuple[IndexEntry | None, IndexEntry | None]:
        with self.txn.cursor(db=self.ix.ages) as cur:
            first = self.entry(cur.value()) if cur.first() else None
            last = self.entry(cur.value()) if cur.last() else None
        return first, last

    def live_in_segment(self, seg: int) -> Iterator[tuple[int, bytes]]:
        """``(offset, key)`` of the records the index still points at in ``seg``, file order."""
        with self.txn.cursor(db=self.ix.locs) as cur:
            if not cur.set_range(_LOC.pack(seg, 0)):
                return
            for k, v in cur:
                if len(k) != _LOC.size:
                    continue  # not written by this code: skip it
                s, off = _LOC.unpack(k)
                if s != seg:
                    return
                yield off, bytes(v)


class IndexWriter(IndexView):
    """One write transaction; keeps ``locs``, ``ages`` and segment accounting in step.

    Segment accounting changes are summed in memory and written once at commit, so a batch
    of N blocks costs one read-modify-write per segment instead of N.
    """

    def __init__(self, index: BlockIndex) -> None:
        super().__init__(index, index.env.begin(write=True))
        self._seg_delta: dict[int, list[int]] = {}  # seg -> [live bytes, records, end]

    def __enter__(self) -> "IndexWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.txn.abort()
            return
        try:
            for seg in self._seg_delta:
                self.txn.put(_U64.pack(seg), _SEG.pack(*self.segment(seg)), db=self.ix.segments)
        except BaseException:
            self.txn.abort()
            raise
        self.txn.commit()

    def segment(self, seg: int) -> SegmentInfo | None:
        cur = super().segment(seg)
        d = self._seg_delta.get(seg)
        if d is None:
            return cur
        cur = cur or SegmentInfo(0, 0, 0)
        return SegmentInfo(
            max(0, cur.live_bytes + d[0]), max(cur.end, d[2]), max(0, cur.live_records + d[1])
        )

    def _seg_add(self, seg: int, live: int, count: int, end: int = 0) -> None:
        d = self._seg_delta.get(seg)
        if d is None:
            d = self._seg_delta[seg] = [0, 0, 0]
        d[0] += live
        d[1] += count
        if end > d[2]:
            d[2] = end

    def set_segment_end(self, seg: int, end: int) -> None:
        self._seg_add(seg, 0, 0, end)

    def drop_segment(self, seg: int) -> None:
        self._seg_delta.pop(seg, None)
        self.txn.delete(_U64.pack(seg), db=self.ix.segments)

    def _unlink_entry(self, e: IndexEntry) -> None:
        self.txn.delete(_LOC.pack(e.segment, e.offset), db=self.ix.locs)
        self.txn.delete(_SEQ.pack(e.seq), db=self.ix.ages)
        self._seg_add(e.segment, -e.length, -1)

    def put(self, key: bytes, entry: IndexEntry) -> IndexEntry | None:
        """Point ``key`` at ``entry``; returns the entry it replaced (now dead bytes)."""
        raw = self.txn.replace(key, entry.pack(), db=self.ix.blocks)
        old = None if raw is None else IndexEntry.unpack(raw)
        if old is not None:
            self._unlink_entry(old)
        self.txn.put(_LOC.pack(entry.segment, entry.offset), key, db=self.ix.locs)
        self.txn.put(_SEQ.pack(entry.seq), key, db=self.ix.ages)
        self._seg_add(entry.segment, entry.length, 1)
        return old

    def delete(self, key: bytes, expect: IndexEntry | None = None) -> IndexEntry | None:
        """Remove ``key`` (only if it still equals ``expect`` when given); returns what went."""
        raw = self.txn.get(key, db=self.ix.blocks)
        if raw is None:
            return None
        e = IndexEntry.unpack(raw)
        if expect is not None and e != expect:
            return None
        self.txn.delete(key, db=self.ix.blocks)  # an unreadable value goes too
        if e is not None:
            self._unlink_entry(e)
        return e

    def set_meta(self, name: str, value: bytes) -> None:
        self.txn.put(name.encode(), value, db=self.ix.meta)

    def set_meta_int(self, name: str, value: int) -> None:
        self.set_meta(name, _U64.pack(value))

    def add_meta_int(self, name: str, delta: int) -> None:
        self.set_meta_int(name, max(0, self.meta_int(name) + delta))
