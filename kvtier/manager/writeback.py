"""Write-back to the disk tier: demotions planned ahead of need, disk evictions, and the
background transfers that carry them (a mixin of ``TieredOffloadingManager``, split out to keep
each file readable; it shares the manager's state and is not used on its own).

Demotions copy the coldest dirty CPU blocks to disk while they are still resident, so that
evicting them later costs nothing and a store never waits on the disk. The caller runs each
``BackgroundTransfer`` and reports it with ``complete_background``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from kvtier.manager.events import BlockRemoved, BlockStored
from kvtier.manager.specs import BackgroundTransfer, BlockKey, LoadStoreSpec, Medium
from kvtier.manager.tier_index import BlockState

log = logging.getLogger("kvtier.manager.tiered")  # the name operators already filter on


class WriteBack:
    """Flush planning and background transfers; see the module docstring."""
    def _plan_flushes(self, completion: bool = False, window: int = 0) -> None:
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
        room = self.max_demotions_in_flight - self._demoting
        if room <= 0:  # the disk's queue is full: don't walk, don't queue more
            return

        pending_drops, disk = self._pending_drops, self.disk
        admit = None if self.disk_admission.admits_everything else self.disk_admission.admit
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
        admitted = admitted[: self.disk_health.admit(len(admitted))]  # degraded: probes only
        if not admitted:
            return
        need = len(admitted) - self.disk.free_count
        if need > 0:
            self._evict_disk(need)
        admitted = admitted[: max(0, self.disk.free_count)]
        if not admitted:
            return
        probe = self.disk_health.on_demotion_started()
        self._demoting += len(admitted)
        slots = slots[: len(admitted)]
        self.cpu.start_flushes(slots)
        self.disk.add_many(admitted, BlockState.WRITING)
        t = self._queue_bg(LoadStoreSpec.cpu(slots), LoadStoreSpec.disk(admitted), admitted)
        if probe:
            self._probes.add(t.id)

    def _evict_disk(self, n: int) -> None:
        victims = self.disk.victims(n)
        self.disk.remove_many(victims)
        self.disk_admission.on_evicts(victims)
        self.cpu.forget_disk_copies(victims)
        if victims:
            self.stats.evicted_blocks["DISK"] += len(victims)
            self.events.emit(BlockRemoved(Medium.DISK, tuple(victims)))
            self._drop_everywhere(victims)

    def _drop_everywhere(self, keys: Sequence[BlockKey]) -> None:
        """Delete the disk records of ``keys`` (no longer indexed) on every worker.

        With tensor parallelism each rank holds its own slice of a block in its own directory,
        and a background transfer runs on every rank. So when the index forgets a block whose
        write (or read: ``complete_load``) failed on one rank only, the other ranks' slices
        must be deleted too, or they stay on disk unindexed: never served, never evicted, over
        capacity. A rank without the record deletes nothing. (Slices left by a crash are
        deleted at the next start-up: ``stale`` of ``_restore_disk``.)"""
        if not keys:
            return
        for key in keys:
            self._pending_drops[key] = self._pending_drops.get(key, 0) + 1
        self._queue_bg(LoadStoreSpec.disk(keys), LoadStoreSpec.drop(keys), keys)

    def _queue_bg(self, src: LoadStoreSpec, dst: LoadStoreSpec, keys: Sequence[BlockKey]
                  ) -> BackgroundTransfer:
        t = BackgroundTransfer(next(self._bg_ids), src, dst, tuple(keys))
        self._bg_pending[t.id] = t
        self._bg_ready.append(t)
        return t

    def take_background_transfers(self) -> list[BackgroundTransfer]:
        out, self._bg_ready = self._bg_ready, []
        return out

    def complete_background(self, transfer_id: int, success: bool = True) -> None:
        t = self._bg_pending.pop(transfer_id, None)
        if t is None:
            self.stats.protocol_errors += 1
            return
        if t.dst.medium is Medium.REMOTE:
            self._remote_write_done(t, success)
            return
        if t.dst.medium is Medium.DROP:
            for key in t.keys:
                left = self._pending_drops.get(key, 0) - 1
                if left > 0:
                    self._pending_drops[key] = left
                else:
                    self._pending_drops.pop(key, None)
            return
        self._demoting -= len(t.keys)
        self._cleaned_since_behind += len(t.keys)  # turned clean (or failed): worth a search
        self.cpu.finish_flushes(t.keys, success)
        if success:  # the disk copies being written (not dropped meanwhile) become READY
            stored, unwritten = self.disk.publish_stored_writes(t.keys), []
        else:
            stored, unwritten = [], self.disk.remove_many(self.disk.stored_writes(t.keys))
        self._drop_everywhere(unwritten)  # the ranks where the write worked keep nothing
        probe = transfer_id in self._probes
        self._probes.discard(transfer_id)
        self.disk_health.on_demotion(success, probe=probe)
        self.stats.disk_degraded = self.disk_health.degraded
        self.stats.disk_degradations = self.disk_health.degradations
        if success:
            self.stats.stored_blocks["DISK"] += len(stored)
            self.events.emit(BlockStored(Medium.DISK, tuple(stored)))
        else:
            self.stats.failed_stores["DISK"] += len(t.keys)
            log.warning("kvtier: demotion of %d blocks to disk failed", len(t.keys))

    def _restore_disk(self, keys_oldest_first: Iterable[BlockKey],
                      stale: Iterable[BlockKey] = ()) -> None:
        """Index the blocks a previous run left on disk; delete ``stale`` ones (on some
        ranks only: unusable) and the oldest beyond capacity, on every worker."""
        self._drop_everywhere(list(dict.fromkeys(stale)))
        keys = list(keys_oldest_first)
        overflow = max(0, len(keys) - self.disk.capacity)
        if overflow:
            log.warning("kvtier: disk holds %d blocks over its capacity; evicting the oldest", overflow)
        for key in keys[overflow:]:
            self.disk.add(key, BlockState.READY)
        self._drop_everywhere(keys[:overflow])
