"""CPU-tier eviction of the tiered manager: which blocks go, and what losing them costs.

A mixin of :class:`~kvtier.manager.tiered.TieredOffloadingManager` (its state: ``cpu``,
``disk``, ``disk_health``, admission, ``_pending_drops``, ``_write_back_behind``,
``_cleaned_since_behind``, ``eviction_budget``, ``stats``, ``events``). Kept apart because the rule is the subtle part:
clean blocks first, dirty ones only when write-back is behind, never a pinned one.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.manager.events import BlockRemoved
from kvtier.manager.specs import BlockKey, Medium


class CpuEviction:
    def _disk_declines(self, key: BlockKey) -> bool:
        """A dirty CPU block the disk would not keep anyway (refused, or being dropped)."""
        return key in self._pending_drops or not self.disk_admission.would_admit(key)

    def _declines_test(self):
        """``_disk_declines`` as cheap as it can be for this walk: None (nothing declined: a
        walk step checks only flags) or a C-level membership test when the disk admits
        everything."""
        if not self.disk_admission.admits_everything:
            return self._disk_declines
        return self._pending_drops.__contains__ if self._pending_drops else None

    def _evict_cpu(self, n: int) -> list[BlockKey]:
        """Evict up to ``n`` unpinned CPU blocks; a block being read (a load, a demotion) or
        written is never evicted.

        Blocks whose eviction loses nothing (a copy on disk, a failed flush, or
        ``_disk_declines``: write-back keeps the coldest ones so) go first, in the policy's
        order. They are looked for among the coldest ``eviction_budget`` unpinned blocks
        only; if too few are there, write-back is behind (the disk is slower than the
        stores, or one store needs more than the flush window holds) and the coldest dirty
        blocks are dropped unwritten (``evicted_unwritten``); the next search then looks
        only as deep as the blocks demotions made clean since (``_write_back_behind``):
        this is a cache, and the coldest block is the one worth least, so losing its disk copy
        beats refusing the new blocks. The old rule never dropped a dirty block the disk
        would take: with demotions in flight every eviction walked the whole tier looking
        for a clean one (200-250 ms per store at 50k blocks), then refused the store anyway.
        """
        if self.disk is None or self.disk_health.degraded:  # any unpinned block may go
            victims = self.cpu.victims(n)
        else:
            budget = self.eviction_budget
            if self._write_back_behind:
                # The last search came up short: deeper than the flush window every block is
                # dirty (write-back cleans the coldest first), so searching the whole budget
                # again finds only the blocks turned clean since (a 512-block store walked
                # 3k blocks per request in vain: 10 ms of a 1B model's 8k recompute step).
                budget = min(budget, self._cleaned_since_behind)
            # budget 0 (searched in vain, and no demotion finished since): the coldest n
            victims, clean = self.cpu.victims_preferring(n, self._declines_test(), n + budget)
            unwritten = len(victims) - clean
            self.stats.evicted_unwritten += unwritten
            self._write_back_behind = unwritten > 0
            self._cleaned_since_behind = 0
        self._drop_cpu(victims)
        return victims

    def _drop_cpu(self, keys: Sequence[BlockKey]) -> None:
        """Evict ``keys`` from the CPU tier: one event for the batch, not one per block."""
        gone = self.cpu.remove_many(keys)
        self.cpu_admission.on_evicts(gone)
        self.stats.evicted_blocks["CPU"] += len(gone)
        self.events.emit(BlockRemoved(Medium.CPU, tuple(gone)))

    def _make_room(self, n: int) -> bool:
        if self.cpu.free_count < n:
            self._evict_cpu(n - self.cpu.free_count)
        return self.cpu.free_count >= n
