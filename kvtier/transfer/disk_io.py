"""CPU <-> disk block moves and disk deletions, executed against a disk tier.

The disk side is a ``SlotDisk`` (kvtier.tiers.disk.slot_io): a store in this process wrapped
in ``SlotIO``, or the disk I/O process (kvtier.tiers.disk.io.process), which maps the same pool
memory. These handlers check the job and split reads across threads; only slot ids and keys
cross into the disk side. A block that cannot be read back (missing, corrupt, unreadable) is
an expected event on disk, so it is reported in ``failed_keys`` instead of failing the job:
the manager then forgets those keys (and deletes them on every rank) and the engine recomputes
them. Reads that failed for a reason that says nothing about the record (EIO, EMFILE ...) are
also in ``transient_keys``, so they are not counted as corruption. Writes are all-or-nothing
per job (``put_slots`` raises), because a store that half-failed cannot tell the manager which
keys it may publish.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Sequence

from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.disk.slot_io import RecordStore, SlotDisk, SlotIO
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import TransferOutcome

log = logging.getLogger(__name__)


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


def slot_disk(pool: CpuBlockPool, disk: SlotDisk | RecordStore) -> SlotDisk:
    """``disk`` itself when it works by slot (the disk I/O process), else a store of this
    process wrapped to read and write the pool's slots."""
    if hasattr(disk, "put_slots"):
        return disk  # type: ignore[return-value]
    return SlotIO(disk, lambda s: _slot_buffer(pool, s))  # type: ignore[arg-type]


class CpuToDiskHandler(TransferHandler):
    """Demotion: CPU slots (src) -> disk records under ``keys`` (dst), one batch per job."""

    direction = (Medium.CPU, Medium.DISK)

    def __init__(self, pool: CpuBlockPool, disk: SlotDisk | RecordStore, *,
                 concurrency: int = 1) -> None:
        self.pool = pool
        self.disk = slot_disk(pool, disk)
        self.concurrency = concurrency

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        _check_pairs(self.name, self.pool, src.ids, dst.keys)
        if not src.ids:
            return TransferOutcome()
        await self.run_blocking(self.disk.put_slots, list(src.ids), list(dst.keys))
        return TransferOutcome(bytes=len(src.ids) * self.pool.geometry.block_bytes)


class DiskToCpuHandler(TransferHandler):
    """Promotion: disk records (src keys) -> CPU slots (dst), read by up to ``read_threads``
    threads per job (a disk keeps several reads in flight far better than one)."""

    direction = (Medium.DISK, Medium.CPU)

    def __init__(
        self, pool: CpuBlockPool, disk: SlotDisk | RecordStore, *, concurrency: int = 4,
        read_threads: int = 4
    ) -> None:
        if not isinstance(read_threads, int) or read_threads < 1:
            raise ValueError(f"read_threads must be an int >= 1, got {read_threads!r}")
        self.pool = pool
        self.disk = slot_disk(pool, disk)
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
            *(self.run_blocking(self.disk.fetch_slots, keys[p.start:p.stop], slots[p.start:p.stop])
              for p in parts)
        )
        failed = sorted(p.start + i for p, (part, _) in zip(parts, parts_failed) for i in part)
        transient = sorted(p.start + i for p, (_, part) in zip(parts, parts_failed) for i in part)
        return TransferOutcome(
            bytes=(n - len(failed)) * self.pool.geometry.block_bytes,
            failed_keys=tuple(keys[i] for i in failed),
            transient_keys=tuple(keys[i] for i in transient),
        )


class DiskDropHandler(TransferHandler):
    """Deletion of disk records (src keys); the destination spec carries nothing."""

    direction = (Medium.DISK, Medium.DROP)

    def __init__(self, disk: SlotDisk | RecordStore, *, concurrency: int = 1) -> None:
        self.disk = disk
        self.concurrency = concurrency

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        if src.keys:
            await self.run_blocking(self.disk.delete_many, list(src.keys))
        return TransferOutcome()
