"""The worker side of one process: CPU pool, disk store and transfer engine, wired from config.

It runs transfer jobs and hands back results; it decides nothing about placement. vLLM's
worker process owns one of these (the scheduler process owns the manager); ``kvtier bench``
owns both in one process. Both build jobs the way the connector's worker side does
(``kvtier.transfer.jobs`` for loads, ``engine.submit`` of the plan's specs for stores and
background moves): there is no second, bench-only way to submit a job.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import KvtierConfig
from kvtier.tiers.disk.io.process import DiskProcess, store_options
from kvtier.tiers.remote.io.process import RemoteIOProcesses
from kvtier.runtime.gil import SwitchInterval
from kvtier.tiers.disk.io.replicated import ReplicatedDisk
from kvtier.tiers.cpu_pool import CpuBlockPool
from kvtier.tiers.host import HostAddress, HostClient
from kvtier.tiers.disk import DiskStore
from kvtier.tiers.disk.errors import DiskIndexUnreadable
from kvtier.tiers.gpu_view import GpuKvView
from kvtier.tiers.layout import BlockGeometry
from kvtier.tiers.remote.wire.connect import remote_keys
from kvtier.tiers.remote.secrets import RemoteSecrets
from kvtier.transfer import JobResult, TransferEngine, TransferHandler
from kvtier.transfer.cpu_copy import CpuToGpuHandler, GpuToCpuHandler
from kvtier.transfer.disk_io import CpuToDiskHandler, DiskDropHandler, DiskToCpuHandler
from kvtier.transfer.remote_io import CpuToRemoteHandler, RemoteToCpuHandler

log = logging.getLogger(__name__)


def gpu_handlers(view: GpuKvView, pool: CpuBlockPool, *,
                 store_copy: str = "kernel") -> list[TransferHandler]:
    """The fastest GPU<->CPU copiers available for ``view``'s device; ``store_copy``: the
    CUDA store's path (``tiers.cpu.store_copy``)."""
    if view.device.type == "cuda":
        try:
            from kvtier.transfer.cuda import CudaCpuToGpuHandler, CudaGpuToCpuHandler
        except ImportError as exc:
            log.warning("kvtier: CUDA copy path unavailable (%s); using plain torch copies", exc)
        else:
            return [CudaGpuToCpuHandler(view, pool, store_copy=store_copy),
                    CudaCpuToGpuHandler(view, pool)]
    return [GpuToCpuHandler(view, pool), CpuToGpuHandler(view, pool)]


def attach_host_pool(config: KvtierConfig, fingerprint: str, geometry: BlockGeometry,
                     rank: int, instance: str) -> tuple[HostClient, int]:
    """Connect this rank to the host tier (starting its service if none runs) and take its
    rank's pool: the connection (held for the rank's life: its end tells the service the
    rank is gone) and the pool's file descriptor."""
    client = HostClient.connect(HostAddress.from_config(config.host, fingerprint,
                                                        geometry.block_bytes),
                                instance or f"pid-{os.getpid()}")
    try:
        return client, client.attach(rank, geometry.block_bytes)
    except OSError:
        client.close()
        raise


@dataclass
class WorkerRuntime:
    geometry: BlockGeometry
    pool: CpuBlockPool
    store: DiskStore | DiskProcess | None  # DiskProcess: served by a child (tiers/disk/io/process.py)
    engine: TransferEngine
    remote: RemoteIOProcesses | None = None  # the shared tier's I/O (tiers/remote/io/process.py)
    replica: ReplicatedDisk | None = None  # rank > 0 of a replicated layout: rank 0's disk
    switch: SwitchInterval | None = None  # lowered GIL switch interval, put back on close
    host: HostClient | None = None  # the host tier's connection: held while this rank lives

    @classmethod
    def create(cls, config: KvtierConfig, view: GpuKvView, geometry: BlockGeometry, *,
               rank: int = 0, world_size: int = 1, rank0_geometry: BlockGeometry | None = None,
               replicated: bool = False, rank0_disk: Path | None = None,
               fill: str = "now", instance: str = "",
               host_fingerprint: str = "") -> "WorkerRuntime":
        """``replicated``: every rank holds the same bytes (MLA), so the shared tier keeps one
        value per block: rank 0 writes it (under ``rank0_geometry``, rank 0's), every rank
        reads it. The disk tier too, when ``rank0_disk`` (rank 0's directory) is given: a rank
        > 0 reads rank 0's records and writes none (see tiers/disk/io/replicated.py). ``fill``: when
        the CPU pool allocates its chunks after the first (``CpuBlockPool``); vLLM's worker
        passes ``"on_start"`` and starts it once vLLM's start-up is over, since page-locking
        holds up the process's other CUDA calls meanwhile. ``instance``: the engine this rank
        belongs to (the host tier: the name its scheduler registered its region under);
        ``host_fingerprint``: the model geometry its host tier serves (rank 0's, the same for
        every rank; default: this rank's)."""
        config.check_block_bytes(geometry.block_bytes)
        d = config.disk
        reads_rank0 = replicated and rank > 0 and rank0_disk is not None  # tiers/disk/io/replicated.py
        own_process = d is not None and d.io_process and not reads_rank0
        # the disk's and the shared tier's I/O processes map the pool: it must be shareable
        shared = own_process or config.remote is not None
        # A shared pool is filled (registered with CUDA) at once all the same: registering it
        # after start-up would run while the I/O processes read into it, and a fresh
        # instance's first REMOTE promotion would wait for the registration (figures:
        # docs/design-measurements.md). A private pool defers as asked.
        host = None
        if config.host is not None:  # the host's pool: every slot id of it, mapped and pinned
            host, fd = attach_host_pool(config, host_fingerprint or geometry.fingerprint(),
                                        geometry, rank, instance)
            pool = CpuBlockPool(geometry, host.total_slots, pin=config.cpu.pin, pool_fd=fd)
        else:
            pool = CpuBlockPool(geometry, config.cpu_slots(geometry.block_bytes),
                                pin=config.cpu.pin, shared=shared, fill="now" if shared else fill)
        store = replica = None
        handlers = gpu_handlers(view, pool, store_copy=config.cpu.store_copy)
        if d is not None:

            def open_store() -> DiskStore:
                return DiskStore(d.path, geometry, **store_options(d))

            disk = None
            if reads_rank0:
                disk = replica = ReplicatedDisk(rank0_disk, rank0_geometry or geometry,
                                                open_store, rank=rank)
            else:
                try:
                    disk = store = (DiskProcess(pool, d, geometry,
                                                gil_switch_interval_ms=config.gil_switch_interval_ms)
                                    if own_process else open_store())
                except DiskIndexUnreadable as exc:
                    # a damaged index or a full file system: serve from CPU memory; demotions
                    # to the missing tier fail and mark it degraded, loads never come from it
                    log.error("kvtier: running without the disk tier: %s", exc)
            if disk is not None:
                handlers += [CpuToDiskHandler(pool, disk), DiskToCpuHandler(pool, disk),
                             DiskDropHandler(disk)]
        remote = None
        if config.remote is not None:  # the children connect in the background
            keys = remote_keys(config.remote, rank0_geometry or geometry, rank=rank,
                               world_size=world_size, replicated=replicated)
            remote = RemoteIOProcesses(pool, config.remote, keys,
                                       RemoteSecrets.load(config.remote))
            handlers += [CpuToRemoteHandler(pool, remote, write=rank == 0 or not replicated),
                         RemoteToCpuHandler(pool, remote)]
        rt = cls(geometry, pool, store, TransferEngine(handlers), remote, replica, host=host)
        # reads through this process's threads want the short interval even when saturated
        rt.switch = SwitchInterval(config.gil_switch_interval_ms,
                                   steady=config.disk is not None or config.remote is not None)
        return rt

    def disk_keys(self) -> list[bytes]:
        """Blocks already on disk, oldest first (the manager's start-up state)."""
        return self.store.keys_by_age() if self.store is not None else []

    def poll(self) -> list[JobResult]:
        return self.engine.get_finished()

    def close(self) -> None:
        self.engine.close()
        if self.switch is not None:
            self.switch.restore()
            self.switch = None
        if self.store is not None:
            self.store.close()
        if self.replica is not None:
            self.replica.close()
        if self.remote is not None:
            self.remote.close()
        if self.host is not None:
            self.host.close()
            self.host = None
