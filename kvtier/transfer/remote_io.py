"""CPU <-> shared tier (Redis / Valkey) block moves.

Like the disk handlers, these connect CPU pool slots to a store and decide nothing. A block the
server does not have (evicted, never written, written by an instance of another geometry, or
corrupt) is reported in ``failed_keys``: the manager forgets it and the engine recomputes it.
A tier that is down fails the whole job at once (``RemoteUnavailable``) instead of waiting.
Encoding runs on the handler's threads; a read's values are verified and copied into their
slots on the store's loop as each lands (``RemoteBlocks.verify_into``).
"""

from __future__ import annotations

from typing import Sequence

from kvtier.manager.specs import BlockKey, LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.remote.blocks import RemoteBlocks
from kvtier.tiers.remote.store import RemoteUnavailable
from kvtier.transfer.disk_io import _check_pairs, _check_promotion, _slot_buffer
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import TransferOutcome


WRITE_JOBS = 4  # CPU -> REMOTE jobs at once (each sends its blocks' SETs concurrently)
READ_JOBS = 4


class CpuToRemoteHandler(TransferHandler):
    """Write-back: CPU slots (src) -> server values under ``keys`` (dst). ``write=False``: a
    rank whose bytes another rank already writes (replicated MLA caches) reports the job done
    without sending anything, so each block is stored once, not once per rank."""

    direction = (Medium.CPU, Medium.REMOTE)

    def __init__(self, pool: CpuBlockPool, blocks: RemoteBlocks, *, concurrency: int = WRITE_JOBS,
                 write: bool = True) -> None:
        self.pool = pool
        self.blocks = blocks
        self.concurrency = concurrency
        self.write = write

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        _check_pairs(self.name, self.pool, src.ids, dst.keys)
        if not src.ids or not self.write:
            return TransferOutcome()
        keys = dst.keys
        values = await self.run_blocking(self._encode, keys, src.ids)
        store = self.blocks.store
        ok = await store.call(store.set_values(self.blocks.server_keys(keys), values))
        # a value the server acknowledged is no longer read by any socket: its buffer is free
        self.blocks.release([v for v, good in zip(values, ok) if good])
        if not any(ok):
            raise RemoteUnavailable(f"the server stored none of {len(keys)} blocks "
                                    f"({store.stats().last_error})")
        return TransferOutcome(bytes=sum(ok) * self.pool.geometry.block_bytes,
                               failed_keys=tuple(k for k, good in zip(keys, ok) if not good))

    def _encode(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[bytes | memoryview]:
        return self.blocks.encode(keys, [_slot_buffer(self.pool, s) for s in slots])


class RemoteToCpuHandler(TransferHandler):
    """Promotion: server values (src keys) -> CPU slots (dst), every value verified."""

    direction = (Medium.REMOTE, Medium.CPU)

    def __init__(self, pool: CpuBlockPool, blocks: RemoteBlocks, *, concurrency: int = READ_JOBS) -> None:
        self.pool = pool
        self.blocks = blocks
        self.concurrency = concurrency

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        keys, slots = src.keys, dst.ids
        _check_promotion(self.name, self.pool, slots, keys)
        if not keys:
            return TransferOutcome()
        store = self.blocks.store

        def landed(i: int, value: bytes | None) -> str:  # on the store's loop, per value
            return self.blocks.verify_into(keys[i], value, _slot_buffer(self.pool, slots[i]))

        verdicts = await store.call(store.get_values(self.blocks.server_keys(keys), landed))
        missed = self.blocks.count(verdicts)
        return TransferOutcome(bytes=(len(keys) - len(missed)) * self.pool.geometry.block_bytes,
                               failed_keys=tuple(keys[i] for i in missed))
