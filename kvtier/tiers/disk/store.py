"""``DiskStore``: the disk tier, block records in segment files behind an LMDB index.

Write path (writer.py): a batch is compressed and checksummed on the caller's thread, appended
to the active segment, made durable with one ``fdatasync`` and published with one LMDB commit.
Data is durable before the index points at it, so after a crash the index only names complete
records; unindexed bytes are garbage that compaction or the open-time truncation removes.

Read path: lock-free with respect to writers (LMDB read transaction + ``preadv`` on a cached
descriptor) and fully verified. A read that loses a race with compaction sees its index entry
move and retries; only a record that is still indexed *and* wrong counts as corruption, which
turns into a miss, a counter and the entry's removal. Callers never get unverified bytes and
never see an exception for bad data.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from typing import Iterable, Sequence

import lmdb

from kvtier.tiers.disk import directory, host, replica
from kvtier.tiers.disk.catalog import lmdb_check
from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.disk.compaction import Compactor
from kvtier.tiers.disk.errors import DiskIndexUnreadable, DiskWriteError, describe_os_error
from kvtier.tiers.disk.catalog.index import BlockIndex, IndexEntry, IndexWriter
from kvtier.tiers.disk.reader import (
    CHECKSUM_FAILURE,
    READ_ERROR,
    ReadFailure,
    ReadStatus,
    read_into,
)
from kvtier.tiers.disk.segments import Buffer, SegmentFiles
from kvtier.tiers.disk.stats import DiskStats, collect, index_dir, segments_dir
from kvtier.tiers.disk.writer import SegmentWriter, as_bytes_view, valid_key
from kvtier.tiers.layout import LAYOUT_VERSION, BlockGeometry

log = logging.getLogger(__name__)

_READ_RETRIES = 4


def _open_index(root: Path, opened: directory.Opened, map_size: int, fsync: bool) -> BlockIndex:
    """Check, then map the index (see lmdb_check: nothing LMDB could fault on gets mapped)."""
    ix_path = index_dir(root)
    lmdb_check.check_free_space(opened.index_fd, ix_path)
    lmdb_check.check_data_file(opened.index_fd, ix_path, root, full=True)
    lmdb_check.allocate_lock_file(opened.index_fd, ix_path, root)
    try:
        return BlockIndex(ix_path, map_size=map_size, sync=fsync, dir_fd=opened.index_fd)
    except lmdb.Error as exc:
        raise lmdb_check.open_error(exc, ix_path, root) from exc


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
        max_open_segments: int | None = None,
    ) -> None:
        """Open (or create) the store at ``path`` for blocks of ``geometry``.

        ``fsync``: a returned ``put_many`` survives a power loss (data synced, then the index
        commit synced). With False nothing is synced: fast, survives process crashes, but a
        power loss may lose recent blocks or damage the index (then delete the directory).

        ``compact_threshold``: sealed segments whose live share drops below it are compacted.
        ``compact_budget_bytes``: bytes a ``delete_many`` call may copy while compacting
        inline (default segment_bytes / 8; 0 leaves compaction to ``compact()``).
        ``max_open_segments``: read descriptors kept open (default: an eighth of the
        RLIMIT_NOFILE soft limit, within [4, 512]).

        Raises DiskStoreBusy, UnsafeDiskDirectory, NotADiskStore, DiskLayoutMismatch, or
        DiskIndexUnreadable (DiskFull for a full file system) naming the path: the caller can
        run without the disk tier.
        """
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        if not 0.0 <= compact_threshold < 1.0:
            raise ValueError(f"compact_threshold must be in [0, 1), got {compact_threshold}")
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.root = Path(path)
        self._closed = True
        codec = BlockCodec(compression, zstd_level)
        self._codec = codec
        self._dir = directory.prepare(self.root)
        try:
            self._index = _open_index(self.root, self._dir, map_size, fsync)
            try:
                next_seq, next_seg = directory.check_meta(self._index, self.root, geometry)
                self._files = SegmentFiles(
                    segments_dir(self.root), os.dup(self._dir.segments_fd),
                    max_open=max_open_segments,
                )
                try:
                    next_seg = directory.open_segments(
                        self._index, self._files, next_seg, segment_bytes, fsync
                    )
                except BaseException:
                    self._files.close()
                    raise
            except BaseException:
                self._index.close()
                raise
        except lmdb.Error as exc:  # e.g. the first commit of a new index on a full disk
            directory.release(self._dir)
            raise lmdb_check.open_error(exc, index_dir(self.root), self.root) from exc
        except OSError as exc:  # what really happened, with the path (never "power loss")
            directory.release(self._dir)
            if isinstance(exc, DiskWriteError):
                raise
            raise DiskIndexUnreadable(
                f"cannot open the disk tier in {self.root}: {describe_os_error(exc)}"
                f"{f' ({exc.filename})' if exc.filename else ''}"
            ) from exc
        except BaseException:
            directory.release(self._dir)
            raise
        self._writer = SegmentWriter(
            self._files, self._index, codec, block_bytes=self.block_bytes,
            segment_bytes=segment_bytes, fsync=fsync, next_seq=next_seq, next_seg=next_seg,
            describe=geometry.describe(),
        )
        budget = compact_budget_bytes if compact_budget_bytes is not None else segment_bytes // 8
        self._compactor = Compactor(self._writer, compact_threshold, max(0, budget))
        self._writer.drop_empty = self._compactor.drop_empty
        self.index_damage: str | None = None  # set once a read finds the live index damaged
        self._damage_lock = threading.Lock()
        self._closed = False
        replica.note_owner(self._dir.index_fd, self._index)  # see replica.py: one env a process
        try:  # lets ranks on this host read this store (replicated layouts, see host.py)
            host.record(self._dir.root_fd)
        except OSError as exc:
            log.warning("kvtier disk tier: cannot record the host in %s (other ranks will keep "
                        "their own copies): %s", self.root, describe_os_error(exc))

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        with self._writer.exclusive():
            if self._closed:
                return
            self._closed = self._writer.closed = True
            replica.note_owner(self._dir.index_fd, None)
            self._files.close()
            self._index.close()
            if self.fsync and self.index_damage is None:  # synced and never seen damaged:
                # the file at rest is consistent (a damaged one is verified at the next open)
                lmdb_check.mark_clean(self._dir.index_fd)
            directory.release(self._dir)

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"DiskStore at {self.root} is closed")

    # -- writing -----------------------------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        """Store blocks durably: one append, one sync and one index commit per batch (batches
        of concurrent callers are merged, see group_commit.py).

        Raises ValueError (bad key or length; nothing written) or DiskWriteError (nothing of
        the batch indexed). A key already present is replaced; its old record becomes dead.
        """
        self._check_open()
        if self.index_damage is not None:
            raise DiskWriteError(errno.EIO, self.index_damage)
        prepared = [self._writer.prepare(k, p) for k, p in items]  # compression runs unlocked
        if prepared:
            self._writer.put(prepared)

    # -- reading -----------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        buf = bytearray(self.block_bytes)
        return bytes(buf) if self.get_into(key, memoryview(buf)) else None

    def get_into(self, key: bytes, out: memoryview) -> bool:
        """Fill ``out`` (writable, block_bytes) with the block; False = miss (out is garbage)."""
        return self.fetch_into(key, out) is ReadStatus.HIT

    def fetch_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """``get_into`` that says why a read missed: TRANSIENT when the read itself failed
        (EIO, EMFILE, ENOMEM ...: the record is kept, nothing counted as corruption), MISS
        when the block is not stored or its record was bad (dropped). With tensor parallelism
        the scheduler deletes a block that failed on any rank from every rank, and counts
        transient failures apart from corruption."""
        self._check_open()
        view = self._out_view(out)
        if not valid_key(key) or self.index_damage is not None:
            return ReadStatus.MISS
        try:
            return self._fetch(key, view)
        except lmdb.Error as exc:  # the index failed under the read: never into the engine
            return self._index_failed(key, exc)

    @property
    def healthy(self) -> bool:
        """False once a read found the open index damaged: reads miss, writes fail."""
        return self.index_damage is None

    def _index_failed(self, key: bytes, exc: lmdb.Error) -> ReadStatus:
        """A read's LMDB error: TRANSIENT for a passing condition (a full reader table ...);
        otherwise the index is damaged, so this and every later read is a miss, every write
        fails (the manager stops writing back) and the index is verified at the next open."""
        self._writer.count(READ_ERROR)
        if not lmdb_check.is_live_damage(exc):
            log.warning("kvtier disk tier: block %s not read this time (kept): index: %s",
                        key.hex()[:32], exc)
            return ReadStatus.TRANSIENT
        with self._damage_lock:
            first = self.index_damage is None
            if first:
                self.index_damage = (
                    f"kvtier disk tier: the index of {self.root} is damaged "
                    f"({type(exc).__name__}: {exc}); disk reads miss and writes fail until it "
                    f"is reopened (delete {self.root} if it is refused then)")
        if first:
            log.error("%s", self.index_damage)
        return ReadStatus.MISS

    def _fetch(self, key: bytes, view: memoryview) -> ReadStatus:
        raw = self._index.get_raw(key)
        if raw is None:
            return ReadStatus.MISS
        entry = IndexEntry.unpack(raw)
        if entry is None:  # a value this code cannot parse: damaged index
            self._drop_unreadable(key)
            return ReadStatus.MISS
        return self._read(key, entry, view)

    def _out_view(self, out: memoryview) -> memoryview:
        view = as_bytes_view(out)
        if view.readonly or view.nbytes != self.block_bytes:
            raise ValueError(
                f"get_into needs a writable buffer of {self.block_bytes} bytes, got "
                f"{view.nbytes}{' (read-only)' if view.readonly else ''}"
            )
        return view

    def _read(self, key: bytes, entry: IndexEntry | None, view: memoryview) -> ReadStatus:
        for _ in range(_READ_RETRIES):
            if entry is None:
                return ReadStatus.MISS
            failure = read_into(self._files, self._codec, key, entry, view, LAYOUT_VERSION)
            if failure is None:
                return ReadStatus.HIT
            if failure.transient:  # says nothing about the record: a miss, nothing dropped
                self._transient(key, failure)
                return ReadStatus.TRANSIENT
            again = self._index.get(key)
            if again == entry:
                self._drop_bad(key, entry, failure)
                return ReadStatus.MISS
            entry = again  # compaction moved it (or it was replaced): read the new place
        return ReadStatus.MISS

    def contains(self, key: bytes) -> bool:
        self._check_open()
        if not valid_key(key) or self.index_damage is not None:
            return False
        try:
            return self._index.get(key) is not None
        except lmdb.Error as exc:
            self._index_failed(key, exc)
            return False

    def _transient(self, key: bytes, failure: ReadFailure) -> None:
        self._writer.count(failure.kind)
        log.warning(
            "kvtier disk tier: block %s not read this time (kept): %s", key.hex()[:32],
            failure.reason,
        )

    def _drop_bad(self, key: bytes, entry: IndexEntry, failure: ReadFailure) -> None:
        log.warning(
            "kvtier disk tier: dropping block %s (segment %d @ %d): %s",
            key.hex()[:32], entry.segment, entry.offset, failure.reason,
        )
        with self._writer.exclusive():
            if self._closed:
                return
            self._writer.count(failure.kind)
            try:
                self._writer.commit(lambda w: w.delete(key, expect=entry), "dropping a bad entry")
            except DiskWriteError:
                return
            self._compactor.drop_empty({entry.segment})

    def _drop_unreadable(self, key: bytes) -> None:
        log.warning("kvtier disk tier: dropping block %s: unreadable index entry", key.hex()[:32])
        with self._writer.exclusive():  # no commit can replace the value under us
            if self._closed:
                return

            def drop(w: IndexWriter) -> None:
                raw = w.txn.get(key, db=w.ix.blocks)
                if raw is not None and IndexEntry.unpack(raw) is None:  # still unreadable
                    w.delete(key)
                    w.add_meta_int(CHECKSUM_FAILURE, 1)

            try:
                self._writer.commit(drop, "dropping an unreadable entry")
            except DiskWriteError:
                return

    # -- deleting and reclaiming ------------------------------------------------------------
    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Remove blocks; returns how many were present. Reclaims space inline (bounded)."""
        self._check_open()
        keys = [k for k in keys if valid_key(k)]
        touched: set[int] = set()
        removed = 0

        def remove(w: IndexWriter) -> None:
            nonlocal removed
            for k in keys:
                e = w.delete(k)
                if e is not None:
                    removed += 1
                    touched.add(e.segment)

        with self._writer.exclusive():
            self._check_open()
            self._writer.commit(remove, "delete")
            self._compactor.drop_empty(touched)
            if self._compactor.budget > 0:
                try:
                    self._compactor.run(budget=self._compactor.budget)
                except DiskWriteError as exc:  # the delete itself succeeded; retried later
                    log.warning("kvtier disk tier: inline compaction failed: %s", exc)
        return removed

    def compact(self) -> int:
        """Compact every sealed segment below the live-ratio threshold; returns bytes reclaimed."""
        self._check_open()
        with self._writer.exclusive():
            self._check_open()
            return self._compactor.run(budget=None)

    # -- inspection --------------------------------------------------------------------------
    def keys_by_age(self) -> list[bytes]:
        """Every stored key, oldest first (by sequence number of its latest write)."""
        self._check_open()
        with self._index.read() as v:
            return v.keys_by_age()

    def stats(self) -> DiskStats:
        self._check_open()
        with self._index.read() as v:
            s = collect(v, self._files)
        unsaved = self._writer.unsaved()
        if unsaved:
            extra = {k: getattr(s, k) + n for k, n in unsaved.items() if hasattr(s, k)}
            s = DiskStats(**{**s.to_dict(), **extra})
        return s

    @staticmethod
    def read_stats(path: str | Path) -> DiskStats:
        """Stats of a store directory without opening it for writing (no geometry needed).

        Run it from another process than the one holding the store open (LMDB refuses a
        second open of one environment within a process).
        """
        return directory.read_stats(Path(path))
