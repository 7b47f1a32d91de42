"""Segment files: append-only files that hold many block records each.

Appending many records to one file (instead of one file per block) turns a batch into one
sequential write and one ``fdatasync``, and keeps the file count and metadata traffic low.

Readers use ``os.pread``/``preadv`` on file descriptors cached here. A segment removed by
compaction may still be under a concurrent read: its descriptor is reference-counted and closed
only when the last reader lets go, so a descriptor number is never reused under a reader.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from pathlib import Path
from typing import Sequence

IOV_MAX = 1024
SUFFIX = ".seg"
KICK_BYTES = 1 << 20  # start write-back after every this many appended bytes (see start_writeback)

Buffer = bytes | bytearray | memoryview


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


class _Handle:
    __slots__ = ("fd", "refs", "retired")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.refs = 0
        self.retired = False


class SegmentFiles:
    """The ``segments/`` directory: read descriptors, the active (appended) segment, removal."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._gone: set[int] = set()
        self.active_id = 0
        self.active_fd = -1
        self.active_end = 0

    def path(self, seg: int) -> Path:
        return self.root / segment_name(seg)

    def on_disk(self) -> dict[int, int]:
        """Segment id -> file size for every segment file present."""
        out: dict[int, int] = {}
        with os.scandir(self.root) as it:
            for de in it:
                seg = parse_segment_name(de.name)
                if seg is not None:
                    try:
                        out[seg] = de.stat().st_size
                    except FileNotFoundError:
                        pass
        return out

    # -- reading ----------------------------------------------------------------------------
    def pread(self, seg: int, bufs: list, offset: int) -> int:
        """``preadv`` from segment ``seg``; FileNotFoundError if it is gone."""
        return self._with_fd(seg, lambda fd: os.preadv(fd, bufs, offset))

    def _with_fd(self, seg: int, fn):
        """Run ``fn(fd)`` with ``seg``'s descriptor pinned: a concurrent ``remove`` closes it
        only afterwards, so its number cannot be reused under this call."""
        lock = self._lock
        with lock:
            h = self._handles.get(seg)
            if h is None:
                if seg in self._gone:
                    raise FileNotFoundError(errno.ENOENT, "segment file was removed")
                h = _Handle(os.open(self.path(seg), os.O_RDONLY | os.O_CLOEXEC))
                self._handles[seg] = h
            h.refs += 1
        try:
            return fn(h.fd)
        finally:
            with lock:
                h.refs -= 1
                if h.retired and h.refs == 0:
                    os.close(h.fd)

    def remove(self, seg: int) -> None:
        """Unlink ``seg``; its descriptor closes once no reader holds it."""
        with self._lock:
            self._gone.add(seg)
            h = self._handles.pop(seg, None)
            if h is not None:
                h.retired = True
                if h.refs == 0:
                    os.close(h.fd)
            try:
                os.unlink(self.path(seg))
            except FileNotFoundError:
                pass

    # -- appending (caller holds the store's writer lock) -------------------------------------
    def open_active(self, seg: int, end: int) -> None:
        """Append to ``seg`` from ``end`` on; bytes past ``end`` are unindexed garbage."""
        self.close_active()
        fd = os.open(self.path(seg), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size > end:
                os.ftruncate(fd, end)
        except BaseException:
            os.close(fd)
            raise
        self.active_id, self.active_fd, self.active_end = seg, fd, end

    def create(self, seg: int, *, sync_dir: bool = True) -> None:
        """Start a new, empty active segment (its directory entry made durable if asked)."""
        self.open_active(seg, 0)
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
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close_active(self) -> None:
        if self.active_fd >= 0:
            os.close(self.active_fd)
        self.active_fd = -1

    def close(self) -> None:
        self.close_active()
        with self._lock:
            for h in self._handles.values():
                h.retired = True
                if h.refs == 0:
                    os.close(h.fd)
            self._handles.clear()
