"""Bookkeeping of one tier: which block sits where, in which state, pinned by whom.

Slot lifecycle (explicit, as SGLang's HiCache does it)::

    free -> WRITING -> READY -> (readers > 0: loading) -> READY -> evicted -> free
                  \\-> failed store -> free

A block is only readable (``lookup`` / ``prepare_load``) in READY, and only evictable in READY
with no readers and no flush in flight. The index never touches bytes; slot ids are handed to
the worker side, which owns the memory.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from enum import Enum

from kvtier.manager.policies import EvictionPolicy
from kvtier.manager.specs import BlockKey, Medium


class BlockState(Enum):
    WRITING = "writing"  # bytes are being written (store, promotion or flush); not readable
    READY = "ready"


@dataclass
class Entry:
    slot: int  # CPU slot id; -1 on tiers addressed by key (disk)
    state: BlockState
    readers: int = 0  # in-flight loads reading this block (pins)
    flushing: bool = False  # CPU only: a copy to disk is reading this slot (pin)
    on_disk: bool = False  # CPU only: a READY copy also exists on disk (clean)
    flush_failed: bool = False  # CPU only: the disk refused it; drop instead of retrying
    promoted: bool = False  # CPU only: WRITING because a load promotes it from disk

    @property
    def pinned(self) -> bool:
        return self.readers > 0 or self.flushing or self.state is not BlockState.READY


class TierIndex:
    """Entries, eviction order and capacity of one tier."""

    def __init__(self, medium: Medium, capacity_blocks: int, policy: EvictionPolicy,
                 with_slots: bool) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"{medium.value} tier capacity must be at least one block")
        self.medium = medium
        self.capacity = capacity_blocks
        self.policy = policy
        self.entries: dict[BlockKey, Entry] = {}
        self._with_slots = with_slots
        self._free: list[int] = list(range(capacity_blocks)) if with_slots else []
        self.evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: BlockKey) -> Entry | None:
        return self.entries.get(key)

    def ready(self, key: BlockKey) -> Entry | None:
        e = self.entries.get(key)
        return e if e is not None and e.state is BlockState.READY else None

    @property
    def free_count(self) -> int:
        return self.capacity - len(self.entries)

    def add(self, key: BlockKey, state: BlockState, parent: BlockKey | None = None) -> Entry:
        """Take a free slot (lowest id first) for ``key``; caller made sure one is free."""
        if key in self.entries:
            raise KeyError(f"{self.medium.value}: block already present")
        if len(self.entries) >= self.capacity:
            raise RuntimeError(f"{self.medium.value}: add() with no free capacity")
        slot = heapq.heappop(self._free) if self._with_slots else -1
        entry = Entry(slot=slot, state=state)
        self.entries[key] = entry
        self.policy.insert(key, parent)
        return entry

    def remove(self, key: BlockKey) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self.policy.remove(key)
        if self._with_slots:
            heapq.heappush(self._free, entry.slot)
        return entry

    def victims(self, n: int, evictable) -> list[BlockKey]:
        if n <= 0:
            return []

        def ok(key: BlockKey) -> bool:
            e = self.entries.get(key)
            return e is not None and not e.pinned and evictable(key, e)

        return self.policy.victims(n, ok)

    def used_slots(self) -> int:
        return len(self.entries)
