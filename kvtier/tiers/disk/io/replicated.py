"""The disk tier of a rank > 0 under a replicated KV layout (MLA): rank 0's records, read only.

Why: every rank holds the same bytes, so one copy on disk is enough. Rank 0 owns and writes
the store (``<path>/rank0``); a rank > 0 on the same host reads rank 0's records through a
read-only :class:`DiskReplica` and writes nothing:

- its CPU -> DISK demotion writes nothing and reports done. That never claims a block nobody
  wrote: the scheduler's job ledger completes a job only when *every* rank reported it, and a
  failure on rank 0 fails it for all, so the manager publishes a disk block only after rank
  0's write committed (and then every rank can read it);
- its DISK -> DROP deletes nothing (rank 0 deletes the one copy);
- a record that is bad on rank 1's read is a miss; the scheduler deletes the block on every
  rank, i.e. rank 0 drops it.

Rank 0's directory is used only when rank 0 recorded this host in it (``tiers.disk.host``):
a rank on another node (multi-node TP, or a shared network file system) falls back to the
per-rank layout, its own store in ``<path>/rank<r>`` written like without replication. The
choice is made when the worker starts if rank 0's record is already there, else at the first
transfer (vLLM runs none before every worker, rank 0 included, registered its KV caches and
so opened its disk tier), and kept for the process's life.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Iterable, Sequence

from kvtier.tiers.disk import DiskStore, ReadStatus, host
from kvtier.tiers.disk.errors import (DiskIndexUnreadable, DiskLayoutMismatch, DiskStoreBusy,
                                      DiskWriteError, NotADiskStore)
from kvtier.tiers.disk.replica import DiskReplica
from kvtier.tiers.layout import BlockGeometry

log = logging.getLogger(__name__)

REPLICA, OWN, NONE = "replica", "own", "none"


class ReplicatedDisk:
    """What the disk handlers of a rank > 0 use: rank 0's records, or the fallback store."""

    def __init__(self, rank0_path: Path, rank0_geometry: BlockGeometry,
                 own_store: Callable[[], DiskStore], *, rank: int) -> None:
        """``own_store`` opens this rank's own directory (the per-rank fallback)."""
        self.rank0_path = Path(rank0_path)
        self.rank0_geometry = rank0_geometry
        self.rank = rank
        self._own_store = own_store
        self._lock = threading.Lock()
        self.mode: str | None = None  # REPLICA | OWN | NONE once decided
        self.replica: DiskReplica | None = None
        self.own: DiskStore | None = None
        if host.served_here(self.rank0_path):
            self._decide()

    def _decide(self) -> str:
        with self._lock:
            if self.mode is not None:
                return self.mode
            if host.served_here(self.rank0_path):
                self.replica = DiskReplica(self.rank0_path, self.rank0_geometry)
                self.mode = REPLICA
                log.info("kvtier: rank %d reads rank 0's disk tier %s (replicated layout, "
                         "written once)", self.rank, self.rank0_path)
                return self.mode
            log.warning("kvtier: rank 0's disk tier %s is not served from this host; rank %d "
                        "keeps its own copy (per-rank layout)", self.rank0_path, self.rank)
            try:
                self.own = self._own_store()
                self.mode = OWN
            except (DiskIndexUnreadable, DiskLayoutMismatch, DiskStoreBusy, NotADiskStore,
                    OSError) as exc:
                log.error("kvtier: rank %d runs without the disk tier: %s", self.rank, exc)
                self.mode = NONE
            return self.mode

    # -- what the disk handlers call ----------------------------------------------------------
    def put_many(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> None:
        mode = self._decide()
        if mode == OWN:
            assert self.own is not None
            self.own.put_many(items)
        elif mode == NONE:
            raise DiskWriteError(f"rank {self.rank} has no disk tier")
        # REPLICA: rank 0 writes the one copy (see the module docstring)

    def fetch_into(self, key: bytes, out: memoryview) -> ReadStatus:
        mode = self._decide()
        if mode == REPLICA:
            assert self.replica is not None
            return self.replica.fetch_into(key, out)
        if mode == OWN:
            assert self.own is not None
            return self.own.fetch_into(key, out)
        return ReadStatus.MISS

    def delete_many(self, keys: Iterable[bytes]) -> int:
        if self._decide() == OWN:
            assert self.own is not None
            return self.own.delete_many(keys)
        return 0  # REPLICA: rank 0 deletes the one copy

    def close(self) -> None:
        with self._lock:
            replica, own = self.replica, self.own
            self.mode = self.mode or NONE
        if replica is not None:
            replica.close()
        if own is not None:
            own.close()
