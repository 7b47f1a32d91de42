"""Segment files: append-only files that hold many block records each.

Appending many records to one file (instead of one file per block) turns a batch into one
sequential write and one ``fdatasync``, and keeps the file count and metadata traffic low.

Readers use ``os.pread``/``preadv`` on file descriptors cached here. The cache is a bounded
LRU (a store with thousands of segments must not run the process out of descriptors); a
descriptor is reference-counted, and closed (on eviction or when compaction removes its
segment) only when the last reader lets go, so a descriptor number is never reused under a
reader. No lock is held across an ``open`` or any I/O.

Every name is opened relative to one ``segments/`` directory descriptor (opened once with
``O_NOFOLLOW``): a renamed or swapped directory tree cannot redirect the store. New segments
are created with ``O_EXCL|O_NOFOLLOW``; segments are read with ``O_NOFOLLOW|O_NONBLOCK`` and
must be regular files, so a symlink, FIFO or directory in a segment's place is an error for
that read (never a hang, never someone else's file).

An error that says nothing about the bytes on disk (out of descriptors or memory, EIO, a
permission change) is *transient*: the read is a miss, and nothing is dropped or unlinked.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Sequence

IOV_MAX = 1024
SUFFIX = ".seg"
KICK_BYTES = 1 << 20  # start write-back after every this many appended bytes (see start_writeback)

Buffer = bytes | bytearray | memoryview

log = logging.getLogger(__name__)

# Errors that prove nothing about the record: the read is a miss, the entry stays.
TRANSIENT_ERRNOS = frozenset({
    errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EIO, errno.EAGAIN, errno.EINTR,
    errno.ENOBUFS, errno.EACCES, errno.EPERM,
})
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def open_dir(name: str | Path, dir_fd: int | None = None) -> int:
    """A directory descriptor; ELOOP/ENOTDIR if ``name`` is a symlink or not a directory."""
    return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def default_max_open() -> int:
    """Cached read descriptors: an eighth of the soft RLIMIT_NOFILE, within [4, 512]."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = 1024
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        soft = 4096
    return max(4, min(512, soft // 8))


def segment_name(seg: int) -> str:
    return f"{seg:08d}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    stem = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) != 8 or not stem.isdigit():
        return None
    return int(stem)


def _load_sync_file_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range now (non-blocking; only a hint).

    Without it, dirty pages sit in the page cache until the batch's ``fdatasync``, so copying
    the batch and writing it to the device happen one after the other. Kicking write-back per
    megabyte lets the device work while the rest of the batch is still being copied; the
    closing ``fdatasync`` then waits only for the tail. Errors surface at that ``fdatasync``.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def pwrite_all(fd: int, bufs: Sequence[Buffer], offset: int) -> int:
    """Write ``bufs`` back to back at ``offset`` (partial writes resumed); returns bytes written."""
    want = sum(len(b) for b in bufs)
    if len(bufs) <= IOV_MAX:
        n = os.pwritev(fd, bufs, offset)
        if n == want:
            return n
    else:
        n = 0
    # Rare path: too many buffers, or the kernel wrote only part of them.
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    total = 0
    i = 0
    skip = n
    while i < len(views):
        if skip:
            n, skip = skip, 0
        else:
            n = os.pwritev(fd, views[i : i + IOV_MAX], offset + total)
            if n == 0:
                raise OSError(errno.EIO, "pwritev wrote nothing")
        total += n
        while n and i < len(views):  # drop what was written, trim a partly written buffer
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
    return total


class NotARegularFile(OSError):
    """A segment name holds a FIFO, directory, device or socket (planted or damaged)."""


class _Handle:
    __slots__ = ("fd", "refs", "retired")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 0
        self.retired = False


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class SegmentFiles:
    """The ``segments/`` directory: read descriptors, the active (appended) segment, removal.

    ``dir_fd`` (owned: closed by :meth:`close`) is the directory, opened with O_NOFOLLOW;
    -1 stands for a missing directory (read-only stats of a damaged store: no segments).
    """

    def __init__(self, root: Path, dir_fd: int, *, max_open: int | None = None) -> None:
        self.root = root
        self.dir_fd = dir_fd
        self.max_open = max(1, max_open if max_open is not None else default_max_open())
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()  # scandir on a dup shares the directory offset
        self._handles: OrderedDict[int, _Handle] = OrderedDict()  # least recently used first
        self._gone: set[int] = set()
        self.active_id = 0
        self.active_fd = -1
        self.active_end = 0

    def path(self, seg: int) -> Path:
        return self.root / segment_name(seg)

    def open_count(self) -> int:
        with self._lock:
            return len(self._handles)

    def scan(self) -> tuple[dict[int, int], set[int]]:
        """(segment id -> size of every regular segment file, ids whose name holds anything
        else). A removed ``segments/`` directory lists as empty."""
        sizes: dict[int, int] = {}
        strays: set[int] = set()
        if self.dir_fd < 0:
            return sizes, strays
        with self._scan_lock, os.scandir(self.dir_fd) as it:
            for de in it:
                seg = parse_segment_name(de.name)
                if seg is None:
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    sizes[seg] = st.st_size
                else:
                    strays.add(seg)
        return sizes, strays

    def on_disk(self) -> dict[int, int]:
        """Segment id -> file size for every segment file present."""
        return self.scan()[0]

    # -- reading ----------------------------------------------------------------------------
    def pread(self, seg: int, bufs: list, offset: int) -> int:
        """``preadv`` from segment ``seg``; FileNotFoundError if it is gone, NotARegularFile if
        something else holds its name, a transient OSError (see is_transient) if it cannot be
        opened or read right now."""
        h = self._acquire(seg)
        try:
            return os.preadv(h.fd, bufs, offset)
        finally:
            self._release(h)

    def _open_read(self, seg: int) -> int:
        name = segment_name(seg)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            with self._lock:  # out of descriptors: give back every idle one, retry once
                idle = self._trim(0)
            _close_all(idle)
            fd = os.open(name, _READ_FLAGS, dir_fd=self.dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(
                    errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL,
                    "not a regular file", str(self.path(seg)),
                )
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _acquire(self, seg: int) -> _Handle:
        with self._lock:
            h = self._handles.get(seg)
            if h is not None:
                h.refs += 1
                self._handles.move_to_end(seg)
                return h
            if seg in self._gone:
                raise FileNotFoundError(errno.ENOENT, "segment file was removed")
        fd = self._open_read(seg)  # no lock held: an open may block (NFS, FUSE) or fail
        spare: list[int] = []
        with self._lock:
            if seg in self._gone:
                spare.append(fd)
                h = None
            else:
                h = self._handles.get(seg)
                if h is None:
                    h = self._handles[seg] = _Handle(fd)
                else:  # another reader opened it meanwhile
                    spare.append(fd)
                    self._handles.move_to_end(seg)
                h.refs += 1
                spare += self._trim(self.max_open)
        _close_all(spare)
        if h is None:
            raise FileNotFoundError(errno.ENOENT, "segment file was removed")
        return h

    def _trim(self, keep: int) -> list[int]:
        """Evict idle descriptors, oldest first, until at most ``keep`` are cached (busy ones
        stay: they close when released). Caller holds the lock; returns the descriptors to
        close once it has let go."""
        out: list[int] = []
        excess = len(self._handles) - keep
        if excess <= 0:
            return out
        for seg, h in list(self._handles.items()):
            if excess <= 0:
                break
            if h.refs == 0:
                del self._handles[seg]
                out.append(h.fd)
                excess -= 1
        return out

    def _release(self, h: _Handle) -> None:
        """Drop one reference. Concurrent reads can leave more than ``max_open`` handles
        cached (an acquire cannot trim busy ones), so the release trims back to the cap: an
        idle descriptor over the cap may be holding a removed file's space."""
        with self._lock:
            h.refs -= 1
            spare = [h.fd] if h.retired and h.refs == 0 else []
            if len(self._handles) > self.max_open:
                spare += self._trim(self.max_open)
        _close_all(spare)

    def remove(self, seg: int) -> None:
        """Unlink ``seg``; its descriptor closes once no reader holds it. Something other than
        a file under its name (a planted directory) is left in place and logged."""
        spare: list[int] = []
        with self._lock:
            self._gone.add(seg)
            h = self._handles.pop(seg, None)
            if h is not None:
                h.retired = True
                if h.refs == 0:
                    spare.append(h.fd)
        _close_all(spare)
        try:
            os.unlink(segment_name(seg), dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("kvtier disk tier: cannot remove segment %s: %s", self.path(seg), exc)

    # -- appending (caller holds the store's writer lock) -------------------------------------
    def open_active(self, seg: int, end: int) -> None:
        """Append to the existing ``seg`` from ``end`` on; bytes past ``end`` are unindexed
        garbage and are cut off."""
        self.close_active()
        fd = self._open_read_write(seg, os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(errno.EINVAL, "not a regular file", str(self.path(seg)))
            os.set_blocking(fd, True)
            if st.st_size > end:
                os.ftruncate(fd, end)
        except BaseException:
            os.close(fd)
            raise
        self.active_id, self.active_fd, self.active_end = seg, fd, end

    def _open_read_write(self, seg: int, extra: int) -> int:
        return os.open(
            segment_name(seg), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | extra, 0o600,
            dir_fd=self.dir_fd,
        )

    def create(self, seg: int, *, sync_dir: bool = True) -> None:
        """Start a new, empty active segment (its directory entry made durable if asked).

        O_EXCL: a name someone planted (file, link, FIFO) is never reused or followed.
        """
        self.close_active()
        self.active_fd = self._open_read_write(seg, os.O_CREAT | os.O_EXCL)
        self.active_id, self.active_end = seg, 0
        if sync_dir:
            self.sync_dir()
    def append(self, bufs: Sequence[Buffer], *, kick: bool = False) -> int:
        """Write ``bufs`` at the end of the active segment; returns their offset.

        ``kick``: start write-back every KICK_BYTES (when a sync will follow).
        """
        offset = self.active_end
        if not kick:
            self.active_end = offset + pwrite_all(self.active_fd, bufs, offset)
            return offset
        chunk: list[Buffer] = []
        size = 0
        for b in bufs:
            chunk.append(b)
            size += len(b)
            if size >= KICK_BYTES:
                self._append_kicked(chunk)
                chunk, size = [], 0
        if chunk:
            self._append_kicked(chunk)
        return offset

    def _append_kicked(self, bufs: Sequence[Buffer]) -> None:
        start = self.active_end
        self.active_end = start + pwrite_all(self.active_fd, bufs, start)
        start_writeback(self.active_fd, start, self.active_end - start)

    def rollback(self, end: int) -> bool:
        """Cut the active segment back to ``end`` after a failed write; False if that failed."""
        try:
            os.ftruncate(self.active_fd, end)
        except OSError:
            return False
        self.active_end = end
        return True

    def sync_active(self) -> None:
        os.fdatasync(self.active_fd)

    def sync_dir(self) -> None:
        os.fsync(self.dir_fd)

    def close_active(self) -> None:
        if self.active_fd >= 0:
            os.close(self.active_fd)
        self.active_fd = -1

    def close(self) -> None:
        self.close_active()
        spare: list[int] = []
        with self._lock:
            for h in self._handles.values():
                h.retired = True
                if h.refs == 0:
                    spare.append(h.fd)
            self._handles.clear()
            if self.dir_fd >= 0:
                spare.append(self.dir_fd)
                self.dir_fd = -1
        _close_all(spare)

