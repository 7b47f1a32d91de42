"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) as an eviction plug-in.

ARC keeps two resident lists, T1 (seen once recently) and T2 (seen at least twice), and two
ghost lists B1/B2 of keys recently evicted from each. A re-inserted key found in a ghost list
tells which list was too small, and the target size ``p`` of T1 moves towards it. This makes
ARC resistant to one-time scans (they only churn T1) while still following recency shifts.

In kvtier the manager, not the policy, decides when to evict: ``victims`` only *proposes* keys
following ARC's REPLACE rule, and a key enters a ghost list when ``remove`` is called. Every
operation is O(1) amortised (four :class:`KeyedList`, so nothing pauses in proportion to the
cache size; ghost trimming pops each ghost at most once).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from kvtier.manager.keyed_list import KeyedList
from kvtier.manager.policies.base import Evictable, EvictionPolicy, register_policy
from kvtier.manager.specs import BlockKey


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        c = self.capacity = capacity_blocks
        self.p = 0.0  # target size of T1
        # Bounds: the manager keeps |T1|+|T2| <= c; _trim_ghosts keeps |B1| <= c, |B2| <= 2c.
        self._t1, self._t2 = KeyedList(c), KeyedList(c)
        self._b1, self._b2 = KeyedList(c), KeyedList(2 * c)

    # -- contract --------------------------------------------------------------------------
    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if key in self._t1 or key in self._t2:
            self.access(key)
            return
        c = self.capacity
        b1, b2 = self._b1, self._b2
        if b1.pop(key) is not None:  # T1 was too small: grow its target
            self.p = min(float(c), self.p + max(b2.size / (b1.size + 1), 1.0))
            self._t2.push(key)
        elif b2.pop(key) is not None:  # T2 was too small: shrink T1's target
            self.p = max(0.0, self.p - max(b1.size / (b2.size + 1), 1.0))
            self._t2.push(key)
        else:
            self._t1.push(key)
        self._trim_ghosts()

    def access(self, key: BlockKey) -> None:
        if self._t1.pop(key) is not None:
            self._t2.push(key)
        else:
            self._t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if self._t1.pop(key) is not None:
            self._b1.push(key)
        elif self._t2.pop(key) is not None:
            self._b2.push(key)
        else:
            return
        self._trim_ghosts()

    def victims(self, n: int, evictable: Evictable) -> list[BlockKey]:
        out: list[BlockKey] = []
        if n <= 0:
            return out
        from_t1 = _evictable_iter(self._t1, evictable)
        from_t2 = _evictable_iter(self._t2, evictable)
        t1_left = len(self._t1)  # T1's size as if the victims so far were already gone
        while len(out) < n:
            # REPLACE: take T1's LRU while T1 exceeds its target, else T2's LRU; when the
            # preferred list has nothing evictable left, fall back to the other one.
            order = (from_t1, from_t2) if t1_left > self.p else (from_t2, from_t1)
            key = None
            for source in order:
                key = next(source, None)
                if key is not None:
                    break
            if key is None:
                break
            if source is from_t1:
                t1_left -= 1
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def keys(self) -> Iterable[BlockKey]:
        yield from self._t1
        yield from self._t2

    # -- internals -------------------------------------------------------------------------
    def ghost_size(self) -> int:
        return len(self._b1) + len(self._b2)

    def _trim_ghosts(self) -> None:
        """Keep ARC's invariants |T1|+|B1| <= c and |T1|+|T2|+|B1|+|B2| <= 2c."""
        c = self.capacity
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        while b1.size and t1.size + b1.size > c:
            b1.pop_first()
        while b2.size and t1.size + t2.size + b1.size + b2.size > 2 * c:
            b2.pop_first()
        while b1.size and t1.size + t2.size + b1.size + b2.size > 2 * c:
            b1.pop_first()


def _evictable_iter(order: KeyedList, evictable: Evictable) -> Iterator[BlockKey]:
    """LRU-first keys of ``order`` that pass ``evictable`` (pinned keys are rare: short walk)."""
    for key in order:
        if evictable(key):
            yield key


register_policy("arc", ARCPolicy)
