"""The eviction-order walks of a tier: victims, clean-first victims, the dirty blocks at the
cold end. :class:`~kvtier.manager.index.tier_index.TierIndex` owns one :class:`TierWalks`, built over
the tier's key shards and columns (:class:`~kvtier.manager.index.tier_entry.TierColumns`), and passes
its current eviction policy to each walk (the policy can be swapped: retention hints wrap it).

Kept apart because these walks are the request path's hot loops under write-back: each checks
blocks by handle where the policy offers ``order_at`` (a step costs an array read, not a key
lookup and a call back) and stops after a budget, so a walk is O(budget + pinned blocks passed),
never O(tier).
"""

from __future__ import annotations

from typing import Sequence

from kvtier.manager.policies import EvictionPolicy
from kvtier.manager.specs import BlockKey
from kvtier.manager.index.tier_entry import FLUSH_FAILED as _FLUSH_FAILED
from kvtier.manager.index.tier_entry import FLUSHING as _FLUSHING
from kvtier.manager.index.tier_entry import ON_DISK as _ON_DISK
from kvtier.manager.index.tier_entry import READY as _READY
from kvtier.manager.index.tier_entry import Entry, TierColumns


class _WalkDone(Exception):
    """Ends a policy walk early (the policy's own loop has no budget)."""


class TierWalks:
    """Walks over a policy's order, reading the tier's ``state``/``readers``/``flags`` columns
    by handle; ``shards``: the tier's ``key -> handle`` dicts (``hash(key) % len(shards)``)."""

    def __init__(self, shards: Sequence[dict], columns: TierColumns) -> None:
        self._shards, self._nshards = shards, len(shards)
        self._cols = columns
        self._state, self._readers, self._flags = columns.state, columns.readers, columns.flags

    def victims(self, policy: EvictionPolicy, n: int, evictable=None) -> list[BlockKey]:
        """Up to ``n`` unpinned READY keys, in the policy's order, that also pass
        ``evictable(key, entry)`` when given."""
        if n <= 0:
            return []
        shards, nshards = self._shards, self._nshards
        state, readers, flags = self._state, self._readers, self._flags
        first = policy.victims_at(n) if evictable is None else None
        if first is not None:  # the usual case: none of the coldest n is pinned
            for h in first[1]:
                if h < 0 or state[h] != _READY or readers[h] > 0 or flags[h] & _FLUSHING:
                    break
            else:
                return first[0]

        def ok(key: BlockKey) -> bool:
            h = shards[hash(key) % nshards].get(key)
            if h is None or state[h] != _READY or readers[h] > 0 or flags[h] & _FLUSHING:
                return False
            return evictable is None or evictable(key, Entry(self._cols, h))

        return policy.victims(n, ok)

    def _unpinned_in_order(self, policy: EvictionPolicy):
        """Unpinned READY ``(key, handle)`` in the policy's order, lazily, checked by handle
        (``policy.order_at``); None when the policy has no such order."""
        order = policy.order_at()
        if order is None:
            return None
        shards, nshards = self._shards, self._nshards
        state, readers, flags = self._state, self._readers, self._flags

        def walk():
            for key, h in order:
                if h < 0:
                    h = shards[hash(key) % nshards].get(key, -1)
                    if h < 0:
                        continue
                if state[h] == _READY and not readers[h] and not flags[h] & _FLUSHING:
                    yield key, h
        return walk()

    def victims_preferring(self, policy: EvictionPolicy, n: int, preferred, budget: int
                           ) -> tuple[list[BlockKey], int]:
        """Up to ``n`` unpinned READY keys: first the *clean* ones (a copy on disk, or a failed
        flush) and those passing ``preferred(key)`` (None: no other), in the policy's order,
        among the ``budget`` coldest unpinned ones; then, if that is not enough, the others
        met on the way, coldest first. Returns the keys and how many of them are clean or
        preferred. The walk stops after ``budget`` unpinned keys, so it costs
        O(budget + pinned keys passed), never O(tier)."""
        if n <= 0:
            return [], 0
        flags = self._flags
        clean = _ON_DISK | _FLUSH_FAILED
        taken: list[BlockKey] = []  # accepted by the policy walk, in its order
        others: list[BlockKey] = []
        walk = self._unpinned_in_order(policy)
        if walk is not None:
            for key, h in walk:
                if budget <= 0:
                    break
                budget -= 1
                if flags[h] & clean or preferred is not None and preferred(key):
                    taken.append(key)
                    if len(taken) == n:
                        break
                else:
                    others.append(key)
            return taken + others[: n - len(taken)], len(taken)

        shards, nshards = self._shards, self._nshards
        state, readers = self._state, self._readers
        seen = 0

        def ok(key: BlockKey) -> bool:
            nonlocal seen
            h = shards[hash(key) % nshards].get(key)
            if h is None or state[h] != _READY or readers[h] > 0 or flags[h] & _FLUSHING:
                return False
            if seen >= budget:
                raise _WalkDone
            seen += 1
            if flags[h] & clean or preferred is not None and preferred(key):
                taken.append(key)
                return True
            others.append(key)
            return False

        try:
            policy.victims(n, ok)
        except _WalkDone:
            pass
        return taken + others[: n - len(taken)], len(taken)

    def dirty_among_coldest(self, policy: EvictionPolicy, n: int
                            ) -> tuple[list[BlockKey], list[int]]:
        """Of the ``n`` coldest unpinned READY blocks (policy order), those with no copy on
        disk and no failed flush, and their handles: what write-back copies next. One walk
        (it runs on every store; the walk steps over pinned blocks, which stay few)."""
        flags = self._flags
        clean = _ON_DISK | _FLUSH_FAILED
        dirty: list[BlockKey] = []
        handles: list[int] = []
        if n <= 0:
            return dirty, handles
        walk = self._unpinned_in_order(policy)
        if walk is not None:
            for key, h in walk:
                if not flags[h] & clean:
                    dirty.append(key)
                    handles.append(h)
                n -= 1
                if n == 0:
                    break
            return dirty, handles

        shards, nshards = self._shards, self._nshards
        state, readers = self._state, self._readers

        def ok(key: BlockKey) -> bool:
            h = shards[hash(key) % nshards].get(key)
            if h is None or state[h] != _READY or readers[h] > 0 or flags[h] & _FLUSHING:
                return False
            if not flags[h] & clean:
                dirty.append(key)
                handles.append(h)
            return True

        policy.victims(n, ok)
        return dirty, handles
