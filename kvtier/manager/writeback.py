"""Write-back to the disk tier: demotions planned ahead of need, disk evictions, deletions of
disk records on every worker, and the settling of the background transfers that carry them.

Demotions copy the coldest dirty CPU blocks to disk while they are still resident, so that
evicting them later costs nothing and a store never waits on the disk. The caller runs each
``BackgroundTransfer`` and reports it with ``complete_background``; the manager hands a
demotion's report to :meth:`WriteBack.demotion_done` and a deletion's to
:meth:`WriteBack.drop_done`.

:class:`WriteBack` is built by the tiered manager with the tiers, admission, disk health,
counters, event bus and background queue it works on, and keeps its own state: demotions in
flight, deletions in flight (``pending_drops``) and the transfer ids of a degraded disk's
probes. Without a disk tier it plans nothing.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

from kvtier.manager.admission import AdmissionPolicy
from kvtier.manager.background import BackgroundQueue
from kvtier.manager.disk_health import DiskHealth
from kvtier.manager.events import BlockRemoved, BlockStored, EventBus
from kvtier.manager.specs import BackgroundTransfer, BlockKey, LoadStoreSpec, Medium
from kvtier.manager.stats import ManagerStats
from kvtier.manager.index.tier_index import BlockState, TierIndex

log = logging.getLogger("kvtier.manager.tiered")  # the name operators already filter on


def default_flush_reserve(cpu_blocks: int) -> int:
    """Bounded: the flush walk runs on the request path."""
    return min(cpu_blocks, max(8, min(256, cpu_blocks // 16)))


class WriteBack:
    """Flush planning, disk evictions and deletions; see the module docstring.

    ``flush_reserve``: how many of the coldest CPU blocks are kept clean (None: from the CPU
    tier's size). ``max_demotions_in_flight`` (None: four flush reserves) bounds the disk's
    write queue, and with it the pinned blocks an eviction or flush walk steps over at the
    cold end of the CPU order (each walk is O(this), not O(tier))."""

    def __init__(self, *, cpu: TierIndex, disk: TierIndex | None, admission: AdmissionPolicy,
                 health: DiskHealth, stats: ManagerStats, events: EventBus,
                 background: BackgroundQueue, flush_reserve: int | None = None,
                 max_demotions_in_flight: int | None = None) -> None:
        self.cpu, self.disk = cpu, disk
        self.admission = admission
        self.health = health
        self.stats = stats
        self.events = events
        self.background = background
        if flush_reserve is None:
            flush_reserve = default_flush_reserve(cpu.capacity)
        self.flush_reserve = max(1, flush_reserve)
        self.max_demotions_in_flight = max(1, max_demotions_in_flight or 4 * self.flush_reserve)
        self.demoting = 0  # CPU blocks whose demotion is queued or running
        self.pending_drops: dict[BlockKey, int] = {}  # key -> open DROP jobs
        self._probes: set[int] = set()  # demotions let through as a degraded disk's probe

    # ------------------------------------------------------------------ what eviction asks
    def declines(self, key: BlockKey) -> bool:
        """A dirty CPU block the disk would not keep anyway (refused, or being dropped)."""
        return key in self.pending_drops or not self.admission.would_admit(key)

    def declines_test(self) -> Callable[[BlockKey], bool] | None:
        """``declines`` as cheap as it can be for one eviction walk: None (nothing declined: a
        walk step checks only flags) or a C-level membership test when the disk admits
        everything."""
        if not self.admission.admits_everything:
            return self.declines
        return self.pending_drops.__contains__ if self.pending_drops else None

    # ------------------------------------------------------------------ demotions
    def plan(self, completion: bool = False, window: int = 0) -> None:
        """Copy the coldest dirty CPU blocks to disk before they are needed as victims.

        The walk costs O(window + demotions in flight), so it runs where the cold end
        moves: after evictions (``prepare_store``). A completion makes blocks readable or
        unpins them at the hot end, which only reaches the cold window in a tier not much
        bigger than that window (``completion``: skip the walk otherwise).

        ``window``: the store just planned; the next one of its size evicts that many, so the
        walk looks that deep (at least ``flush_reserve``). With a fixed window of 256, stores
        of 512 blocks had half their blocks evicted unwritten however fast the disk.
        """
        if self.disk is None or self.cpu.free_count >= self.flush_reserve:
            return
        if completion and len(self.cpu) > 2 * (self.flush_reserve + self.max_demotions_in_flight):
            return
        room = self.max_demotions_in_flight - self.demoting
        if room <= 0:  # the disk's queue is full: don't walk, don't queue more
            return

        pending_drops, disk = self.pending_drops, self.disk
        admit = None if self.admission.admits_everything else self.admission.admit
        admitted: list[BlockKey] = []
        slots: list[int] = []
        for key, slot in zip(*self.cpu.dirty_among_coldest(max(self.flush_reserve, window))):
            if key in pending_drops:
                continue
            if key in disk:  # already there (or being written): nothing to copy
                self.cpu.get(key).on_disk = disk.ready(key) is not None
                continue
            if admit is not None and not admit(key):
                self.stats.admission_rejected["DISK"] += 1
                continue
            admitted.append(key)
            slots.append(slot)
        admitted = admitted[:room]
        admitted = admitted[: self.health.admit(len(admitted))]  # degraded: probes only
        if not admitted:
            return
        need = len(admitted) - self.disk.free_count
        if need > 0:
            self._evict_disk(need)
        admitted = admitted[: max(0, self.disk.free_count)]
        if not admitted:
            return
        probe = self.health.on_demotion_started()
        self.demoting += len(admitted)
        slots = slots[: len(admitted)]
        self.cpu.start_flushes(slots)
        self.disk.add_many(admitted, BlockState.WRITING)
        t = self.background.queue(LoadStoreSpec.cpu(slots), LoadStoreSpec.disk(admitted),
                                  admitted)
        if probe:
            self._probes.add(t.id)

    def demotion_done(self, t: BackgroundTransfer, success: bool) -> None:
        """Settle a reported CPU -> DISK transfer (``complete_background``)."""
        self.demoting -= len(t.keys)
        self.cpu.finish_flushes(t.keys, success)
        if success:  # the disk copies being written (not dropped meanwhile) become READY
            stored, unwritten = self.disk.publish_stored_writes(t.keys), []
        else:
            stored, unwritten = [], self.disk.remove_many(self.disk.stored_writes(t.keys))
        self.drop_everywhere(unwritten)  # the ranks where the write worked keep nothing
        probe = t.id in self._probes
        self._probes.discard(t.id)
        self.health.on_demotion(success, probe=probe)
        self.stats.disk_degraded = self.health.degraded
        self.stats.disk_degradations = self.health.degradations
        if success:
            self.stats.stored_blocks["DISK"] += len(stored)
            self.events.emit(BlockStored(Medium.DISK, tuple(stored)))
        else:
            self.stats.failed_stores["DISK"] += len(t.keys)
            log.warning("kvtier: demotion of %d blocks to disk failed", len(t.keys))

    # ------------------------------------------------------------------ disk evictions, deletions
    def _evict_disk(self, n: int) -> None:
        victims = self.disk.victims(n)
        self.disk.remove_many(victims)
        self.admission.on_evicts(victims)
        self.cpu.forget_disk_copies(victims)
        if victims:
            self.stats.evicted_blocks["DISK"] += len(victims)
            self.events.emit(BlockRemoved(Medium.DISK, tuple(victims)))
            self.drop_everywhere(victims)

    def drop_everywhere(self, keys: Sequence[BlockKey]) -> None:
        """Delete the disk records of ``keys`` (no longer indexed) on every worker.

        With tensor parallelism each rank holds its own slice of a block in its own directory,
        and a background transfer runs on every rank. So when the index forgets a block whose
        write (or read: ``complete_load``) failed on one rank only, the other ranks' slices
        must be deleted too, or they stay on disk unindexed: never served, never evicted, over
        capacity. A rank without the record deletes nothing. (Slices left by a crash are
        deleted at the next start-up: ``stale`` of ``restore``.)"""
        if not keys:
            return
        for key in keys:
            self.pending_drops[key] = self.pending_drops.get(key, 0) + 1
        self.background.queue(LoadStoreSpec.disk(keys), LoadStoreSpec.drop(keys), keys)

    def drop_done(self, t: BackgroundTransfer) -> None:
        """Settle a reported DISK -> DROP transfer (``complete_background``)."""
        for key in t.keys:
            left = self.pending_drops.get(key, 0) - 1
            if left > 0:
                self.pending_drops[key] = left
            else:
                self.pending_drops.pop(key, None)

    def restore(self, keys_oldest_first: Iterable[BlockKey], stale: Iterable[BlockKey] = ()
                ) -> None:
        """Index the blocks a previous run left on disk; delete ``stale`` ones (on some
        ranks only: unusable) and the oldest beyond capacity, on every worker."""
        self.drop_everywhere(list(dict.fromkeys(stale)))
        keys = list(keys_oldest_first)
        overflow = max(0, len(keys) - self.disk.capacity)
        if overflow:
            log.warning("kvtier: disk holds %d blocks over its capacity; evicting the oldest", overflow)
        for key in keys[overflow:]:
            self.disk.add(key, BlockState.READY)
        self.drop_everywhere(keys[:overflow])
