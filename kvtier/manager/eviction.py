"""CPU-tier eviction of the tiered manager: which blocks go, and what losing them costs.

Kept apart because the rule is the subtle part: clean blocks first, dirty ones only when
write-back is behind, never a pinned one. :class:`CpuEviction` is built by the tiered manager
with the CPU tier, its admission, the disk's health, counters and event bus, and the
write-back's test for blocks the disk would not keep (``declines_test``); its own state is how
deep the next search looks (``write_back_behind`` and the blocks cleaned since).
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvtier.manager.admission import AdmissionPolicy
from kvtier.manager.disk_health import DiskHealth
from kvtier.manager.events import BlockRemoved, EventBus
from kvtier.manager.specs import BlockKey, Medium
from kvtier.manager.stats import ManagerStats
from kvtier.manager.index.tier_index import TierIndex


class CpuEviction:
    """Evicts CPU blocks; see the module docstring.

    ``disk_backed``: a disk tier takes the CPU tier's blocks (False: any unpinned block may
    go). ``budget``: how far past the batch an eviction looks for a block it can drop
    losslessly. ``declines_test``: called once per eviction, returns None or a
    ``key -> bool`` test for dirty blocks the disk would not keep anyway."""

    def __init__(self, *, cpu: TierIndex, admission: AdmissionPolicy, disk_backed: bool,
                 health: DiskHealth, stats: ManagerStats, events: EventBus, budget: int,
                 declines_test: Callable[[], Callable[[BlockKey], bool] | None],
                 retire: Callable[[Sequence[BlockKey]], set] | None = None) -> None:
        self.cpu = cpu
        self.admission = admission
        self.disk_backed = disk_backed
        self.health = health
        self.stats = stats
        self.events = events
        self.budget = budget
        self._declines_test = declines_test
        # host tier: takes the victims back from the other instances first; those being
        # read there stay (``HostTier.retire``)
        self._retire = retire
        # The last eviction had to drop dirty blocks: the next one searches only as deep as
        # the blocks demotions made clean since (none: it takes the coldest straight away).
        self.write_back_behind = False
        self._cleaned_since_behind = 0

    def note_cleaned(self, n: int) -> None:
        """``n`` CPU blocks finished their demotion (turned clean, or failed): worth a search."""
        self._cleaned_since_behind += n

    def evict(self, n: int) -> list[BlockKey]:
        """Evict up to ``n`` unpinned CPU blocks; a block being read (a load, a demotion) or
        written is never evicted.

        Blocks whose eviction loses nothing (a copy on disk, a failed flush, or declined by
        the disk: write-back keeps the coldest ones so) go first, in the policy's order.
        They are looked for among the coldest ``budget`` unpinned blocks only; if too few
        are there, write-back is behind (the disk is slower than the stores, or one store
        needs more than the flush window holds) and the coldest dirty blocks are dropped
        unwritten (``evicted_unwritten``); the next search then looks only as deep as the
        blocks demotions made clean since (``write_back_behind``): this is a cache, and the
        coldest block is the one worth least, so losing its disk copy beats refusing the new
        blocks. The old rule never dropped a dirty block the disk would take: with
        demotions in flight every eviction walked the whole tier looking for a clean one
        (hundreds of ms per store at 50k blocks), then refused the store anyway (figures:
        docs/design-measurements.md, "kvtier/manager/eviction.py").
        """
        if not self.disk_backed or self.health.degraded:  # any unpinned block may go
            victims = self.cpu.victims(n)
        else:
            budget = self.budget
            if self.write_back_behind:
                # The last search came up short: deeper than the flush window every block is
                # dirty (write-back cleans the coldest first), so searching the whole budget
                # again finds only the blocks turned clean since (a 512-block store walked
                # 3k blocks per request in vain, a visible share of a recompute step).
                budget = min(budget, self._cleaned_since_behind)
            # budget 0 (searched in vain, and no demotion finished since): the coldest n
            victims, clean = self.cpu.victims_preferring(n, self._declines_test(), n + budget)
            unwritten = len(victims) - clean
            self.stats.evicted_unwritten += unwritten
            self.write_back_behind = unwritten > 0
            self._cleaned_since_behind = 0
        return self._drop(victims)

    def _drop(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Evict ``keys`` from the CPU tier (but those another instance is reading): one
        event for the batch, not one per block. Returns the keys evicted."""
        if self._retire is not None and keys:
            busy = self._retire(keys)
            if busy:
                keys = [k for k in keys if k not in busy]
        gone = self.cpu.remove_many(keys)
        self.admission.on_evicts(gone)
        self.stats.evicted_blocks["CPU"] += len(gone)
        self.events.emit(BlockRemoved(Medium.CPU, tuple(gone)))
        return gone

    def make_room(self, n: int) -> bool:
        """Evict until ``n`` CPU slots are free; whether they are."""
        if self.cpu.free_count < n:
            self.evict(n - self.cpu.free_count)
        return self.cpu.free_count >= n
