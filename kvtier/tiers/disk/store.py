"""``DiskStore``: the disk tier, block records in segment files behind an LMDB index.

Write path: a batch is compressed and checksummed outside the lock, then appended to the active
segment with one vectored write, made durable with one ``fdatasync`` and published with one
LMDB commit. The data is durable before the index points at it, so after a crash the index only
ever names complete records; unindexed bytes are garbage that compaction or the open-time
truncation removes.

Read path: lock-free with respect to writers (LMDB read transaction + ``preadv`` on a cached
descriptor) and fully verified. A read that loses a race with compaction sees its index entry
move and retries; only a record that is still indexed *and* wrong counts as corruption, which
turns into a miss, a counter and the entry's removal. Callers never get unverified bytes and
never see an exception for bad data.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Iterable, Sequence

import lmdb

from kvtier.tiers.disk import directory
from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.disk.compaction import Compactor
from kvtier.tiers.disk.errors import DiskWriteError
from kvtier.tiers.disk.index import BlockIndex, IndexEntry, IndexWriter
from kvtier.tiers.disk.reader import READ_ERROR, ReadFailure, read_into
from kvtier.tiers.disk.record import MAX_KEY_BYTES, data_checksum, encode_head, record_length
from kvtier.tiers.disk.segments import Buffer, SegmentFiles
from kvtier.tiers.disk.stats import DiskStats, collect, index_dir, segments_dir
from kvtier.tiers.layout import LAYOUT_VERSION, BlockGeometry

log = logging.getLogger(__name__)

_READ_RETRIES = 4


def _as_bytes_view(buf: Buffer) -> memoryview:
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _valid_key(key: object) -> bool:
    return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES


class DiskStore:
    def __init__(
        self,
        path: str | Path,
        geometry: BlockGeometry,
        *,
        compression: str = "none",
        zstd_level: int = 1,
        fsync: bool = True,
        segment_bytes: int = 256 * 2**20,
        map_size: int = 1 << 34,
        compact_threshold: float = 0.5,
        compact_budget_bytes: int | None = None,
    ) -> None:
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        if not 0.0 <= compact_threshold < 1.0:
            raise ValueError(f"compact_threshold must be in [0, 1), got {compact_threshold}")
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.codec = BlockCodec(compression, zstd_level)
        self.root = Path(path)
        self._closed = True
        self._wlock = threading.Lock()
        self._unsaved: dict[str, int] = {}  # counters whose index write failed, saved later
        self._sealed: set[int] = set()  # segments sealed by the batch being written
        self._lock_fd = directory.prepare(self.root)
        try:
            self._index = BlockIndex(index_dir(self.root), map_size=map_size, sync=fsync)
            try:
                self._next_seq, next_seg = directory.check_meta(self._index, self.root, geometry)
                self._files = SegmentFiles(segments_dir(self.root))
                self._next_seg = directory.open_segments(
                    self._index, self._files, next_seg, segment_bytes, fsync
                )
            except BaseException:
                self._index.close()
                raise
        except BaseException:
            directory.release(self._lock_fd)
            raise
        self._compactor = Compactor(
            self, compact_threshold,
            compact_budget_bytes if compact_budget_bytes is not None else max(1, segment_bytes // 8),
        )
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            self._files.close()
            self._index.close()
            directory.release(self._lock_fd)

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"DiskStore at {self.root} is closed")

    # -- writing -----------------------------------------------------------------------------
    def _prepare(self, key: bytes, payload: Buffer) -> tuple[bytes, int, Buffer, int, int]:
        if not _valid_key(key):
            raise ValueError(
                f"disk block key must be 1..{MAX_KEY_BYTES} bytes, got "
                f"{type(key).__name__} of length {len(key) if isinstance(key, bytes) else '?'}"
            )
        mv = _as_bytes_view(payload)
        if mv.nbytes != self.block_bytes:
            raise ValueError(
                f"disk block payload must be {self.block_bytes} bytes "
                f"({self.geometry.describe()}), got {mv.nbytes}"
            )
        codec, stored = self.codec.encode(mv)
        return key, codec, stored, data_checksum(key, stored), record_length(len(key), len(stored))

    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        """Store blocks durably (one append, one sync, one index commit for the whole batch).

        Raises ValueError (bad key or length; nothing written) or DiskWriteError (nothing of
        the batch indexed). A key already present is replaced; its old record becomes dead.
        """
        self._check_open()
        prepared = [self._prepare(k, p) for k, p in items]  # compression runs unlocked
        if not prepared:
            return
        with self._wlock:
            self._check_open()
            seq0 = self._next_seq
            self._next_seq += len(prepared)
            records = [
                (
                    [encode_head(key, codec=codec, layout_version=LAYOUT_VERSION, seq=seq0 + i,
                                 raw_len=self.block_bytes, stored_len=len(stored), checksum=csum),
                     stored],
                    length,
                )
                for i, (key, codec, stored, csum, length) in enumerate(prepared)
            ]
            places = self._append(records)
            now = time.time()
            freed: set[int] = set()

            def publish(w: IndexWriter) -> None:
                for i, ((key, codec, _s, csum, length), (seg, off)) in enumerate(
                    zip(prepared, places)
                ):
                    entry = IndexEntry(seg, off, length, csum, codec, LAYOUT_VERSION, seq0 + i,
                                       self.block_bytes, now)
                    old = w.put(key, entry)
                    if old is not None:
                        freed.add(old.segment)
                w.set_meta_int("next_seq", self._next_seq)

            self._commit(publish, "index commit")
            freed |= self._sealed
            self._sealed.clear()
            self._compactor.drop_empty(freed)

    def _append(self, records: list[tuple[list[Buffer], int]]) -> list[tuple[int, int]]:
        """Append records (rotating segments as needed) and make them durable.

        Returns ``(segment, offset)`` per record. On an I/O error the partial tail is cut off
        (or, if that fails too, left as dead bytes in a segment that gets sealed) and
        DiskWriteError is raised. Caller holds the writer lock.
        """
        files = self._files
        places: list[tuple[int, int]] = []
        pending: list[Buffer] = []
        start = files.active_end
        try:
            for bufs, length in records:
                end = start + sum(len(b) for b in pending)
                if end > 0 and end + length > self.segment_bytes:
                    self._flush(pending)
                    pending = []
                    self._rotate()
                    start = end = 0
                places.append((files.active_id, end))
                pending.extend(bufs)
            self._flush(pending)
        except OSError as exc:
            if not files.rollback(start):
                self._rotate_after_error()
            self._count("write_errors")
            raise DiskWriteError.wrap(exc, f"writing to {files.path(files.active_id)}") from exc
        return places

    def _flush(self, bufs: list[Buffer]) -> None:
        if bufs:
            self._files.append(bufs)
            if self.fsync:
                self._files.sync_active()

    def _rotate(self) -> None:
        """Seal the active segment and start the next one (registered in the index first)."""
        old, end = self._files.active_id, self._files.active_end
        new = self._next_seg
        self._files.create(new, sync_dir=self.fsync)
        self._next_seg += 1

        def register(w: IndexWriter) -> None:
            w.set_segment_end(old, end)
            w.set_segment_end(new, 0)
            w.set_meta_int("next_segment", self._next_seg)

        self._commit(register, "segment registration", wrap=False)
        self._sealed.add(old)  # checked for emptiness once the batch is published

    def _rotate_after_error(self) -> None:
        try:
            self._rotate()
        except (OSError, lmdb.Error) as exc:  # the next write tries again
            log.error("kvtier disk tier: cannot start a new segment after a write error: %s", exc)

    def _commit(self, fn, what: str, *, wrap: bool = True) -> None:
        """Run ``fn`` in one index write txn; pending counters ride along."""
        try:
            with IndexWriter(self._index) as w:
                fn(w)
                w.set_segment_end(self._files.active_id, self._files.active_end)
                for name, n in self._unsaved.items():
                    w.add_meta_int(name, n)
            self._unsaved.clear()
        except lmdb.Error as exc:
            self._count("write_errors")
            if wrap:
                raise DiskWriteError.wrap(exc, what) from exc
            raise OSError(f"kvtier disk tier: {what} failed: {exc}") from exc

    def _count(self, name: str, n: int = 1) -> None:
        self._unsaved[name] = self._unsaved.get(name, 0) + n

    # -- reading -----------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        buf = bytearray(self.block_bytes)
        return bytes(buf) if self.get_into(key, memoryview(buf)) else None

    def get_into(self, key: bytes, out: memoryview) -> bool:
        """Fill ``out`` (writable, block_bytes) with the block; False = miss (out is garbage)."""
        self._check_open()
        view = _as_bytes_view(out)
        if view.readonly or view.nbytes != self.block_bytes:
            raise ValueError(
                f"get_into needs a writable buffer of {self.block_bytes} bytes, got "
                f"{view.nbytes}{' (read-only)' if view.readonly else ''}"
            )
        if not _valid_key(key):
            return False
        entry = self._index.get(key)
        for _ in range(_READ_RETRIES):
            if entry is None:
                return False
            failure = read_into(self._files, self.codec, key, entry, view, LAYOUT_VERSION)
            if failure is None:
                return True
            again = self._index.get(key)
            if again == entry:
                self._drop_bad(key, entry, failure)
                return False
            entry = again  # compaction moved it (or it was replaced): read the new place
        return False

    def contains(self, key: bytes) -> bool:
        self._check_open()
        return _valid_key(key) and self._index.get(key) is not None

    def _drop_bad(self, key: bytes, entry: IndexEntry, failure: ReadFailure) -> None:
        log.warning(
            "kvtier disk tier: dropping block %s (segment %d @ %d): %s",
            key.hex()[:32], entry.segment, entry.offset, failure.reason,
        )
        with self._wlock:
            if self._closed:
                return
            self._count(failure.kind)
            try:
                self._commit(lambda w: w.delete(key, expect=entry), "dropping a bad entry")
            except DiskWriteError:
                return
            if failure.kind == READ_ERROR or entry.segment != self._files.active_id:
                self._compactor.drop_empty({entry.segment})

    # -- deleting and reclaiming ------------------------------------------------------------
    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove blocks; returns how many were present. Reclaims space inline (bounded)."""
        self._check_open()
        keys = [k for k in keys if _valid_key(k)]
        with self._wlock:
            self._check_open()
            touched: set[int] = set()
            removed = 0

            def remove(w: IndexWriter) -> None:
                nonlocal removed
                for k in keys:
                    e = w.delete(k)
                    if e is not None:
                        removed += 1
                        touched.add(e.segment)

            self._commit(remove, "delete")
            self._compactor.drop_empty(touched)
            try:
                self._compactor.run(budget=self._compactor.budget)
            except DiskWriteError as exc:  # the delete itself succeeded; compaction retries later
                log.warning("kvtier disk tier: inline compaction failed: %s", exc)
        return removed

    def compact(self) -> int:
        """Compact every sealed segment below the live-ratio threshold; returns bytes reclaimed."""
        self._check_open()
        with self._wlock:
            self._check_open()
            return self._compactor.run(budget=None)

    # -- inspection --------------------------------------------------------------------------
    def keys_by_age(self) -> list[bytes]:
        self._check_open()
        with self._index.read() as v:
            return v.keys_by_age()

    def stats(self) -> DiskStats:
        self._check_open()
        with self._index.read() as v:
            s = collect(v, self._files)
        if self._unsaved:
            extra = {k: getattr(s, k) + n for k, n in self._unsaved.items() if hasattr(s, k)}
            s = DiskStats(**{**s.to_dict(), **extra})
        return s

    @staticmethod
    def read_stats(path: str | Path) -> DiskStats:
        """Stats of a store directory without opening it for writing (no geometry needed)."""
        return directory.read_stats(Path(path))
