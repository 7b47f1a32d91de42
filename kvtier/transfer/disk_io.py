"""CPU <-> disk block moves and disk deletions, executed against a disk store.

The store owns the on-disk format, integrity checks and I/O; these handlers only connect it to
CPU pool slots. Slot bytes are handed over as zero-copy memoryviews of the pool. A block that
cannot be read back (missing, corrupt, unreadable) is an expected event on disk, so it is
reported in ``failed_keys`` instead of failing the job: the manager then forgets those keys (and
deletes them on every rank) and the engine recomputes them. Reads that failed for a reason that
says nothing about the record (EIO, EMFILE ...) are also in ``transient_keys``, so they are not
counted as corruption. Writes are all-or-nothing per job (``put_many`` raises), because a
store that half-failed cannot tell the manager which keys it may publish.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable, Protocol, Sequence

from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.disk import ReadStatus
from kvtier.tiers.disk.segments import is_transient
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import TransferOutcome

log = logging.getLogger(__name__)


class DiskStoreLike(Protocol):
    """What these handlers need from the disk store (kvtier.tiers.disk)."""

    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        """Write every item or raise."""

    def fetch_into(self, key: bytes, out: memoryview) -> ReadStatus:
        """Fill ``out`` with the block (HIT); MISS on a miss or corruption (never wrong
        bytes); TRANSIENT when the read failed but the record may be intact (kept)."""

    def delete_many(self, keys: Iterable[bytes]) -> int:
        """Delete keys (unknown ones ignored); returns how many were deleted."""


def _check_pairs(name: str, pool: CpuBlockPool, slots: Sequence[int], keys: Sequence[BlockKey]) -> None:
    if len(slots) != len(keys):
        raise ValueError(f"{name}: {len(keys)} disk keys for {len(slots)} CPU slots")
    bad = [s for s in slots if not 0 <= s < pool.num_slots]
    if bad:
        raise ValueError(f"{name}: CPU slots {bad[:8]} out of range [0, {pool.num_slots})")
    if not all(isinstance(k, bytes) for k in keys):
        raise ValueError(f"{name}: disk keys must be bytes")


def _check_promotion(name: str, pool: CpuBlockPool, slots: Sequence[int],
                     keys: Sequence[BlockKey]) -> None:
    """A read into CPU slots (disk or shared tier): one key per slot, no slot named twice (it
    would end up holding whichever read finished last)."""
    _check_pairs(name, pool, slots, keys)
    if len(set(slots)) != len(slots):
        raise ValueError(f"{name}: duplicate destination CPU slots")


def _slot_buffer(pool: CpuBlockPool, slot: int) -> memoryview:
    """The slot's bytes, writable and zero-copy (waits for the slot's chunk if still allocating)."""
    return memoryview(pool.slot(slot).numpy())


class CpuToDiskHandler(TransferHandler):
    """Demotion: CPU slots (src) -> disk records under ``keys`` (dst), one batch per job."""

    direction = (Medium.CPU, Medium.DISK)

    def __init__(self, pool: CpuBlockPool, store: DiskStoreLike, *, concurrency: int = 1) -> None:
        self.pool = pool
        self.store = store
        self.concurrency = concurrency

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        _check_pairs(self.name, self.pool, src.ids, dst.keys)
        if not src.ids:
            return TransferOutcome()
        await self.run_blocking(self._write, src.ids, dst.keys)
        return TransferOutcome(bytes=len(src.ids) * self.pool.geometry.block_bytes)

    def _write(self, slots: Sequence[int], keys: Sequence[BlockKey]) -> None:
        self.store.put_many([(k, _slot_buffer(self.pool, s)) for k, s in zip(keys, slots)])


class DiskToCpuHandler(TransferHandler):
    """Promotion: disk records (src keys) -> CPU slots (dst), read by up to ``read_threads``
    threads per job (a disk keeps several reads in flight far better than one)."""

    direction = (Medium.DISK, Medium.CPU)

    def __init__(
        self, pool: CpuBlockPool, store: DiskStoreLike, *, concurrency: int = 4, read_threads: int = 4
    ) -> None:
        if not isinstance(read_threads, int) or read_threads < 1:
            raise ValueError(f"read_threads must be an int >= 1, got {read_threads!r}")
        self.pool = pool
        self.store = store
        self.concurrency = concurrency
        self.threads_per_job = read_threads

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        keys, slots = src.keys, dst.ids
        _check_promotion(self.name, self.pool, slots, keys)
        n = len(keys)
        if n == 0:
            return TransferOutcome()
        step = -(-n // min(self.threads_per_job, n))
        parts = [range(i, min(n, i + step)) for i in range(0, n, step)]
        parts_failed = await asyncio.gather(
            *(self.run_blocking(self._read, keys, slots, part) for part in parts)
        )
        failed = sorted(i for part, _ in parts_failed for i in part)
        transient = sorted(i for _, part in parts_failed for i in part)
        return TransferOutcome(
            bytes=(n - len(failed)) * self.pool.geometry.block_bytes,
            failed_keys=tuple(keys[i] for i in failed),
            transient_keys=tuple(keys[i] for i in transient),
        )

    def _read(self, keys: Sequence[BlockKey], slots: Sequence[int], part: range
              ) -> tuple[list[int], list[int]]:
        """Read ``part`` of the pairs; returns the positions that could not be read, and
        those of them whose read failed transiently (the record may be intact)."""
        failed, transient = [], []
        for i in part:
            try:
                status = self.store.fetch_into(keys[i], _slot_buffer(self.pool, slots[i]))
            except OSError as exc:  # an unreadable record is a miss, not a failed job
                log.warning("%s: reading block %s failed: %s", self.name, keys[i].hex()[:16], exc)
                status = ReadStatus.TRANSIENT if is_transient(exc) else ReadStatus.MISS
            if status is not ReadStatus.HIT:
                failed.append(i)
                if status is ReadStatus.TRANSIENT:
                    transient.append(i)
        return failed, transient


class DiskDropHandler(TransferHandler):
    """Deletion of disk records (src keys); the destination spec carries nothing."""

    direction = (Medium.DISK, Medium.DROP)

    def __init__(self, store: DiskStoreLike, *, concurrency: int = 1) -> None:
        self.store = store
        self.concurrency = concurrency

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        if src.keys:
            await self.run_blocking(self.store.delete_many, list(src.keys))
        return TransferOutcome()
