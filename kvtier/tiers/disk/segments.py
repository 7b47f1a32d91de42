"""Segment files: append-only files that hold many block records each.

Appending many records to one file (instead of one file per block) turns a batch into one
sequential write and one ``fdatasync``, and keeps the file count and metadata traffic low.

Readers use ``os.pread``/``preadv`` on file descriptors cached here. A segment removed by
compaction may still be under a concurrent read: its descriptor is reference-counted and closed
only when the last reader lets go, so a descriptor number is never reused under a reader.
"""

from __future__ import annotations

import errno
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

IOV_MAX = 1024
SUFFIX = ".seg"

Buffer = bytes | bytearray | memoryview


def segment_name(seg: int) -> str:
    return f"{seg:08d}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    stem = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or len(stem) != 8 or not stem.isdigit():
        return None
    return int(stem)


def pwrite_all(fd: int, bufs: Sequence[Buffer], offset: int) -> int:
    """Write ``bufs`` back to back at ``offset`` (partial writes resumed); returns bytes written."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    total = 0
    i = 0
    while i < len(views):
        chunk = views[i : i + IOV_MAX]
        n = os.pwritev(fd, chunk, offset + total)
        total += n
        # Skip the buffers the call wrote completely, trim the one it wrote in part.
        while n and i < len(views):
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
    @contextmanager
    def reading(self, seg: int) -> Iterator[int]:
        """A descriptor of ``seg`` valid for the ``with`` block; FileNotFoundError if gone."""
        with self._lock:
            h = self._handles.get(seg)
            if h is None:
                if seg in self._gone:
                    raise FileNotFoundError(errno.ENOENT, "segment file was removed")
                h = _Handle(os.open(self.path(seg), os.O_RDONLY | os.O_CLOEXEC))
                self._handles[seg] = h
            h.refs += 1
        try:
            yield h.fd
        finally:
            with self._lock:
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

    def append(self, bufs: Sequence[Buffer]) -> int:
        """Write ``bufs`` at the end of the active segment; returns their offset."""
        offset = self.active_end
        n = pwrite_all(self.active_fd, bufs, offset)
        self.active_end = offset + n
        return offset

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
