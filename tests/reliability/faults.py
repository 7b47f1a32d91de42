"""Disk fault injection for the disk tier: ENOSPC / EIO on writes, syncs, reads and commits.

``DiskFaults`` swaps the ``os`` module *as seen by* ``kvtier.tiers.disk.segments`` (every
segment write, sync and read goes through it) for a proxy that fails chosen calls, and the
``IndexWriter`` used by the writer for one whose commit fails like a full LMDB map. Nothing
else in the process is affected, so the CPU tier and the transfer engine run for real next to
a disk that misbehaves. Every injected fault is counted by kind.

Kinds: ``write_enospc``, ``write_eio``, ``torn_write`` (part of the bytes land, then ENOSPC),
``fsync_eio``, ``read_eio``, ``index_full`` (the index commit fails).
"""

from __future__ import annotations

import errno
import random
import threading
from collections import Counter

import lmdb

from kvtier.tiers.disk import segments as segments_mod
from kvtier.tiers.disk import writer as writer_mod

KINDS = ("write_enospc", "write_eio", "torn_write", "fsync_eio", "read_eio", "index_full")


class DiskFaults:
    def __init__(self, seed: int = 0) -> None:
        self.rates: dict[str, float] = {}
        self.injected: Counter = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._fail_next_write = False
        self._saved: tuple | None = None

    # -- arming -------------------------------------------------------------------------------
    def arm(self, kind: str, rate: float = 1.0) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {KINDS}")
        with self._lock:
            self.rates[kind] = rate

    def disarm(self, kind: str | None = None) -> None:
        with self._lock:
            if kind is None:
                self.rates.clear()
            else:
                self.rates.pop(kind, None)

    def _hit(self, *kinds: str) -> str | None:
        with self._lock:
            for kind in kinds:
                rate = self.rates.get(kind, 0.0)
                if rate and self._rng.random() < rate:
                    self.injected[kind] += 1
                    return kind
        return None

    # -- installing ---------------------------------------------------------------------------
    def install(self) -> "DiskFaults":
        if self._saved is None:
            self._saved = (segments_mod.os, writer_mod.IndexWriter)
            segments_mod.os = _FaultyOs(segments_mod.os, self)
            writer_mod.IndexWriter = _failing_index_writer(writer_mod.IndexWriter, self)
        return self

    def uninstall(self) -> None:
        if self._saved is not None:
            segments_mod.os, writer_mod.IndexWriter = self._saved
            self._saved = None

    def __enter__(self) -> "DiskFaults":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


class _FaultyOs:
    """``os`` with pwritev / fdatasync / preadv that fail when their fault is armed."""

    def __init__(self, real, faults: DiskFaults) -> None:
        self._real = real
        self._faults = faults

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def pwritev(self, fd, bufs, offset):
        f = self._faults
        with f._lock:
            fail_now, f._fail_next_write = f._fail_next_write, False
        if fail_now:  # the rest of a torn write: the device is full now
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        kind = f._hit("write_enospc", "write_eio", "torn_write")
        if kind == "write_enospc":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if kind == "write_eio":
            raise OSError(errno.EIO, "Input/output error (injected)")
        if kind == "torn_write":
            first = memoryview(bufs[0]).cast("B")
            n = self._real.pwritev(fd, [first[: max(1, len(first) // 2)]], offset)
            with f._lock:
                f._fail_next_write = True
            return n
        return self._real.pwritev(fd, bufs, offset)

    def fdatasync(self, fd):
        if self._faults._hit("fsync_eio"):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return self._real.fdatasync(fd)

    def preadv(self, fd, bufs, offset):
        if self._faults._hit("read_eio"):
            raise OSError(errno.EIO, "Input/output error (injected)")
        return self._real.preadv(fd, bufs, offset)


def _failing_index_writer(base, faults: DiskFaults):
    class FailingIndexWriter(base):
        def __exit__(self, exc_type, exc, tb):
            if exc_type is None and faults._hit("index_full"):
                self.txn.abort()
                raise lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL (injected)")
            return super().__exit__(exc_type, exc, tb)

    return FailingIndexWriter
