"""Disk reads and writes addressed by CPU-pool slot: the one place slot bytes meet records.

Why a slot-level interface: the disk can be served by this process (``SlotIO`` over a store
and the pool's memory) or by a separate disk I/O process that maps the same pool memory
(``kvtier.tiers.disk.io.process``). Either way the transfer handlers say "write slots S under
keys K" and "read keys K into slots S", and only slot ids cross the boundary, never bytes.

Reads report per-block outcomes instead of raising: a block that cannot be read back
(missing, corrupt, unreadable) is an expected event on disk, so its position is returned as
failed (the engine recomputes it); a read that failed for a reason that says nothing about the
record (EIO, EMFILE ...) is also returned as transient, so it is not counted as corruption.
Writes are all-or-nothing per call: the store raises, because a half-failed batch cannot tell
the manager which keys it may publish.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Protocol, Sequence

from kvtier.tiers.disk.reader import ReadStatus
from kvtier.tiers.disk.segments import is_transient

log = logging.getLogger(__name__)


class RecordStore(Protocol):
    """What ``SlotIO`` needs from a disk store (DiskStore, or a replica of rank 0's)."""

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        """Write every item or raise."""

    def fetch_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """Fill ``out`` with the block (HIT); MISS on a miss or corruption (never wrong
        bytes); TRANSIENT when the read failed but the record may be intact (kept)."""

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Delete keys (unknown ones ignored); returns how many were deleted."""


class SlotDisk(Protocol):
    """What the CPU <-> disk transfer handlers use."""

    def put_slots(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """Write slot ``slots[i]``'s bytes under ``keys[i]`` for every i, or raise."""

    def fetch_slots(self, keys: Sequence[bytes], slots: Sequence[int]
                    ) -> tuple[list[int], list[int]]:
        """Read ``keys[i]`` into slot ``slots[i]``; returns (positions not read, those of
        them whose read failed transiently)."""

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Delete keys (unknown ones ignored); returns how many were deleted."""


class SlotIO:
    """``SlotDisk`` over a record store and a function giving a slot's writable bytes."""

    def __init__(self, store: RecordStore, slot_buffer: Callable[[int], memoryview]) -> None:
        self.store = store
        self.slot_buffer = slot_buffer

    def put_slots(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} disk keys for {len(slots)} CPU slots")
        self.store.put_many([(k, self.slot_buffer(s)) for k, s in zip(keys, slots)])

    def fetch_slots(self, keys: Sequence[bytes], slots: Sequence[int]
                    ) -> tuple[list[int], list[int]]:
        if len(slots) != len(keys):
            raise ValueError(f"{len(keys)} disk keys for {len(slots)} CPU slots")
        failed: list[int] = []
        transient: list[int] = []
        for i, (key, slot) in enumerate(zip(keys, slots)):
            try:
                status = self.store.fetch_into(key, self.slot_buffer(slot))
            except OSError as exc:  # an unreadable record is a miss, not a failed job
                log.warning("kvtier disk tier: reading block %s failed: %s", key.hex()[:16], exc)
                status = ReadStatus.TRANSIENT if is_transient(exc) else ReadStatus.MISS
            if status is not ReadStatus.HIT:
                failed.append(i)
                if status is ReadStatus.TRANSIENT:
                    transient.append(i)
        return failed, transient

    def delete_many(self, keys: Iterable[bytes]) -> int:
        return self.store.delete_many(keys)
