"""Reused buffers for the values a write sends, so a SET does not start with a fresh allocation.

A 256 KiB value built with ``b"".join`` lands in freshly mapped memory: the page faults cost
more than the copy itself (~150 us against ~60 us into a warm buffer here, more than the
checksum), once per value written. The write path builds each uncompressed record in a buffer
taken from here and gives a buffer back once the server acknowledged its SET (the server has
every byte: no socket reads it any more); a value whose SET failed or timed out keeps its
buffer, which is simply dropped. At most ``max_bytes`` of idle buffers are kept.
"""

from __future__ import annotations

import threading
from typing import Iterable

MAX_IDLE_BYTES = 64 << 20


class RecordBuffers:
    def __init__(self, max_bytes: int = MAX_IDLE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[bytearray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """A writable buffer of exactly ``size`` bytes (contents undefined)."""
        with self._lock:
            free = self._idle.get(size)
            if free:
                self._idle_bytes -= size
                return memoryview(free.pop())
        return memoryview(bytearray(size))

    def give(self, values: Iterable[object]) -> None:
        """Take back the buffers among ``values`` (other objects are ignored)."""
        with self._lock:
            for v in values:
                buf = v.obj if isinstance(v, memoryview) else None
                if not isinstance(buf, bytearray) or self._idle_bytes + len(buf) > self.max_bytes:
                    continue
                self._idle.setdefault(len(buf), []).append(buf)
                self._idle_bytes += len(buf)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes
