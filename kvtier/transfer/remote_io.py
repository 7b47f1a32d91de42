"""CPU <-> shared tier (Redis / Valkey) block moves.

Like the disk handlers, these connect CPU pool slots to a store and decide nothing. A block the
server does not have (evicted, never written, written by an instance of another geometry,
corrupt or forged) is reported in ``failed_keys``: the manager forgets it and the engine
recomputes it; one lost to a connection is also in ``transient_keys``. A tier that is down
fails the whole job at once (``RemoteUnavailable``) instead of waiting. The bytes move in the
shared tier's I/O processes (``kvtier.tiers.remote.io.process``): this process only hands them
slot ids and keys.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol, Sequence

from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.remote.block_io import FetchResult
from kvtier.tiers.remote.store import RemoteUnavailable
from kvtier.transfer.disk_io import _check_pairs, _check_promotion
from kvtier.transfer.handlers import TransferHandler
from kvtier.transfer.jobs import TransferOutcome


WRITE_JOBS = 8  # CPU -> REMOTE jobs at once (each spread over the I/O processes)
READ_JOBS = 8


class SlotRemote(Protocol):
    """Blocks between CPU slots and the shared tier (``RemoteIOProcesses``)."""

    def put_slots(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[bool]: ...

    def fetch_slots(self, keys: Sequence[bytes], slots: Sequence[int],
                    ready: Callable[[list[int]], None] | None = None) -> FetchResult: ...


class CpuToRemoteHandler(TransferHandler):
    """Write-back: CPU slots (src) -> server values under ``keys`` (dst). ``write=False``: a
    rank whose bytes another rank already writes (replicated MLA caches) reports the job done
    without sending anything, so each block is stored once, not once per rank."""

    direction = (Medium.CPU, Medium.REMOTE)

    def __init__(self, pool: CpuBlockPool, remote: SlotRemote, *,
                 concurrency: int = WRITE_JOBS, write: bool = True) -> None:
        self.pool = pool
        self.remote = remote
        self.concurrency = concurrency
        self.write = write

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        _check_pairs(self.name, self.pool, src.ids, dst.keys)
        if not src.ids or not self.write:
            return TransferOutcome()
        keys = dst.keys
        ok = await self.run_blocking(self.remote.put_slots, list(src.ids), list(keys))
        if not any(ok):
            raise RemoteUnavailable(f"the server stored none of {len(keys)} blocks")
        return TransferOutcome(bytes=sum(ok) * self.pool.geometry.block_bytes,
                               failed_keys=tuple(k for k, good in zip(keys, ok) if not good))


class RemoteToCpuHandler(TransferHandler):
    """Promotion: server values (src keys) -> CPU slots (dst), every value verified. The
    bytes verified so far are timed while it runs (``TransferOutcome.progress``): the cost
    model learns the tier's per-job latency apart from its bandwidth."""

    direction = (Medium.REMOTE, Medium.CPU)

    def __init__(self, pool: CpuBlockPool, remote: SlotRemote, *,
                 concurrency: int = READ_JOBS) -> None:
        self.pool = pool
        self.remote = remote
        self.concurrency = concurrency

    async def run(self, src: LoadStoreSpec, dst: LoadStoreSpec) -> TransferOutcome:
        self.check_media(src, dst)
        keys, slots = src.keys, dst.ids
        _check_promotion(self.name, self.pool, slots, keys)
        if not keys:
            return TransferOutcome()
        block_bytes = self.pool.geometry.block_bytes
        progress: list[tuple[int, float]] = []
        t0 = time.perf_counter()

        def reported(ids: Sequence[int]) -> None:  # the I/O processes' fan-out thread
            done = (progress[-1][0] if progress else 0) + len(ids) * block_bytes
            progress.append((done, time.perf_counter() - t0))

        r = await self.run_blocking(self.remote.fetch_slots, list(keys), list(slots), reported)
        return TransferOutcome(bytes=(len(keys) - len(r.failed)) * block_bytes,
                               failed_keys=tuple(keys[i] for i in r.failed),
                               transient_keys=tuple(keys[i] for i in r.transient),
                               progress=tuple(progress))
