"""``DiskReplica``: a read-only view of a store another process owns on this host.

Why: with a replicated KV layout (MLA: every tensor-parallel rank holds the same bytes) rank 0
writes the disk tier once and ranks > 0 read rank 0's records instead of keeping copies of
their own. A replica must never disturb the owner, so it is strictly read-only:

- it never takes the directory's single-owner lock, creates nothing (no segment, no lock
  file, no ``HOST``), and never writes the index: no drop of a bad record, no counter. A bad
  record is a miss here, reported like any failed read; the scheduler then deletes the block
  on every rank, i.e. rank 0 drops it;
- LMDB is opened read-only: readers in other processes are what LMDB is built for (its reader
  table, ``lock.mdb``, is the owner's and must already exist); the index is checked before it
  is mapped, as the owner does;
- every read is verified (header, key, length, checksum) like the owner's. A read that races
  the owner's compaction or segment removal sees its entry move and retries at the new place;
  if it keeps moving, or the index cannot be read right now, the read is TRANSIENT (a miss
  that proves nothing about the record), never wrong bytes.

A replica caches at most one idle segment descriptor (``MAX_OPEN``): the owner cannot tell it
that compaction removed a segment, and every descriptor kept on a removed file keeps that
file's space in use, so at most one removed segment stays allocated, until the next read of
another segment.

In one process LMDB must not be opened twice (closing the second copy would drop the first's
locks), so a replica of a store this very process owns reads through the owner's index (vLLM
runs each rank in its own process; in one process, as in tests, open the owner first).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

import lmdb

from kvtier.tiers.disk.catalog import lmdb_check
from kvtier.tiers.disk.codec import BlockCodec
from kvtier.tiers.disk.directory import check_owner_mode
from kvtier.tiers.disk.errors import DiskIndexUnreadable, DiskLayoutMismatch, NotADiskStore
from kvtier.tiers.disk.catalog.index import BlockIndex, IndexEntry
from kvtier.tiers.disk.reader import ReadStatus, read_into
from kvtier.tiers.record import FORMAT_VERSION
from kvtier.tiers.disk.segments import SegmentFiles, open_dir
from kvtier.tiers.disk.stats import index_dir, segments_dir
from kvtier.tiers.disk.writer import as_bytes_view, valid_key
from kvtier.tiers.layout import LAYOUT_VERSION, BlockGeometry

log = logging.getLogger(__name__)

_READ_RETRIES = 4
MAX_OPEN = 1  # idle segment descriptors kept (see the module docstring)
_REOPEN_AFTER_S = 1.0  # an index that could not be opened is tried again at most this often

_owners: dict[tuple[int, int], BlockIndex] = {}  # index dir (dev, inode) -> owner's index
_owners_lock = threading.Lock()


def _dir_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def note_owner(index_fd: int, index: BlockIndex | None) -> None:
    """The owning DiskStore of this process registers its index (None: it closed)."""
    key = _dir_id(index_fd)
    with _owners_lock:
        if index is None:
            _owners.pop(key, None)
        else:
            _owners[key] = index


class ReplicaUnavailable(OSError):
    """The owner's store cannot be read right now (not created yet, not served, damaged)."""


class DiskReplica:
    def __init__(self, path: str | Path, geometry: BlockGeometry, *,
                 max_open_segments: int = MAX_OPEN) -> None:
        """Read the store at ``path`` (written for ``geometry``). Opening is lazy and retried:
        the owner may not have created the store yet; until it can be read, reads are
        TRANSIENT."""
        self.root = Path(os.path.abspath(path))
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self._codec = BlockCodec("none", 1)  # decodes any codec a record names
        self._max_open = max_open_segments
        self._lock = threading.Lock()
        self._index: BlockIndex | None = None
        self._own_index = False
        self._files: SegmentFiles | None = None
        self._next_try = 0.0
        self._closed = False

    # -- opening -----------------------------------------------------------------------------
    def _ready(self) -> tuple[BlockIndex, SegmentFiles] | None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"DiskReplica of {self.root} is closed")
            if self._index is not None and self._files is not None:
                return self._index, self._files
            now = time.monotonic()
            if now < self._next_try:
                return None
            self._next_try = now + _REOPEN_AFTER_S
            try:
                self._index, self._own_index, self._files = self._open()
            except (OSError, lmdb.Error, NotADiskStore, DiskLayoutMismatch,
                    DiskIndexUnreadable) as exc:
                log.warning("kvtier disk tier: rank 0's store %s not readable yet: %s",
                            self.root, exc)
                return None
            return self._index, self._files

    def _open(self) -> tuple[BlockIndex, bool, SegmentFiles]:
        """Open the owner's index and segments read-only; raises what ``_ready`` logs (the
        store is then retried later: it may not exist yet, or be replaced by its owner)."""
        root_fd = open_dir(self.root)
        try:
            check_owner_mode(os.fstat(root_fd), self.root)
            ix_fd = open_dir(index_dir(self.root).name, root_fd)
            try:
                index, own = self._open_index(ix_fd)
            finally:
                os.close(ix_fd)
            try:
                self._check_meta(index)
                seg_fd = open_dir(segments_dir(self.root).name, root_fd)
            except BaseException:
                if own:
                    index.close()
                raise
            return index, own, SegmentFiles(segments_dir(self.root), seg_fd,
                                            max_open=self._max_open)
        finally:
            os.close(root_fd)

    def _open_index(self, ix_fd: int) -> tuple[BlockIndex, bool]:
        ix_path = index_dir(self.root)
        check_owner_mode(os.fstat(ix_fd), ix_path)
        with _owners_lock:
            owner = _owners.get(_dir_id(ix_fd))
        if owner is not None:
            return owner, False
        try:  # the owner's reader table: a replica never creates (or resizes) it
            st = os.stat("lock.mdb", dir_fd=ix_fd, follow_symlinks=False)
        except FileNotFoundError:
            raise ReplicaUnavailable(f"{ix_path} has no lock.mdb: its owner never opened it")
        if not stat.S_ISREG(st.st_mode) or st.st_size < lmdb_check.LOCK_BYTES:
            raise ReplicaUnavailable(f"{ix_path / 'lock.mdb'} is not the owner's reader table")
        if not os.path.isfile(f"/proc/self/fd/{ix_fd}/data.mdb"):
            raise ReplicaUnavailable(f"{ix_path} holds no index yet")
        lmdb_check.check_data_file(ix_fd, ix_path, self.root, full=False)
        return BlockIndex(ix_path, map_size=1 << 20, sync=False, readonly=True,
                          dir_fd=ix_fd), True

    def _check_meta(self, index: BlockIndex) -> None:
        with index.read() as v:
            fingerprint = v.meta("fingerprint")
            version = v.meta("format_version")
        if fingerprint is None:
            raise ReplicaUnavailable(f"{self.root} is not initialised yet")
        if version != str(FORMAT_VERSION).encode() or \
                fingerprint.decode(errors="replace") != self.geometry.fingerprint():
            raise DiskLayoutMismatch(
                f"disk tier directory {self.root} holds format {version!r}, fingerprint "
                f"{fingerprint.decode(errors='replace')}; this rank reads format "
                f"{FORMAT_VERSION}, fingerprint {self.geometry.fingerprint()}"
            )

    def _reset(self) -> None:
        """Forget the index after an LMDB error (the owner's environment closed, say)."""
        with self._lock:
            index, own, files = self._index, self._own_index, self._files
            self._index, self._files = None, None
        if files is not None:
            files.close()
        if index is not None and own:
            index.close()

    # -- reading -----------------------------------------------------------------------------
    def fetch_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """Fill ``out`` with the verified block: HIT, MISS (not stored, or its record is bad:
        left for the owner to drop) or TRANSIENT (nothing proven: the index is not readable
        yet, an I/O error, or the record kept moving under compaction)."""
        view = as_bytes_view(out)
        if view.readonly or view.nbytes != self.block_bytes:
            raise ValueError(f"fetch_into needs a writable buffer of {self.block_bytes} bytes, "
                             f"got {view.nbytes}{' (read-only)' if view.readonly else ''}")
        return self._fetch(key, view) if valid_key(key) else ReadStatus.MISS

    def _fetch(self, key: bytes, view: memoryview) -> ReadStatus:
        ready = self._ready()
        if ready is None:
            return ReadStatus.TRANSIENT
        index, files = ready
        try:
            raw = index.get_raw(key)
            if raw is None:
                return ReadStatus.MISS
            entry = IndexEntry.unpack(raw)
            for _ in range(_READ_RETRIES):
                if entry is None:  # deleted meanwhile, or a value this code cannot parse
                    return ReadStatus.MISS
                failure = read_into(files, self._codec, key, entry, view, LAYOUT_VERSION)
                if failure is None:
                    return ReadStatus.HIT
                if failure.transient:
                    return ReadStatus.TRANSIENT
                again = index.get(key)
                if again == entry:  # still indexed and wrong: bad (the owner will drop it)
                    log.warning("kvtier disk tier: block %s in %s is bad: %s", key.hex()[:32],
                                self.root, failure.reason)
                    return ReadStatus.MISS
                entry = again  # moved by compaction (or replaced): read the new place
            return ReadStatus.TRANSIENT
        except lmdb.Error as exc:
            log.warning("kvtier disk tier: index of %s unreadable right now: %s", self.root, exc)
            self._reset()
            return ReadStatus.TRANSIENT

    def close(self) -> None:
        self._reset()
        with self._lock:
            self._closed = True

    def __enter__(self) -> "DiskReplica":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
