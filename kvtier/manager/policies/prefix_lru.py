"""LRU that knows prefix structure: blocks cut off from their prefix are evicted first.

Under prefix semantics a lookup stops at the first missing block, so a resident block whose
parent left the tier can never be hit until that parent is stored again. Such *orphans* should
not hold capacity that reachable blocks could use: they are proposed as victims before any
reachable block. They are not dropped eagerly, because the prefix may come back (the missing
parent is re-stored by the next request that needs it) and the orphan is then re-attached
instead of being written again.

Replay on real and synthetic traces (``kvtier.bench.policy_sim``) showed that strict
leaf-first orders (radix-cache style), frequency orders (LFU, LFU-DA) and ARC/S3-FIFO segment
orders lose to plain LRU on multi-turn chats, so the order among reachable blocks stays LRU;
the big wins come from admission (:mod:`kvtier.manager.admission.reuse_gate`).

All operations are O(1), except that removing a block moves each of its resident children to
the orphan queue once (bounded by its fan-out, never by the cache size).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvtier.manager.policies.base import Evictable, EvictionPolicy, register_policy
from kvtier.manager.specs import BlockKey


class PrefixLRUPolicy(EvictionPolicy):
    name = "prefix_lru"

    def __init__(self, capacity_blocks: int = 0) -> None:
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # reachable, oldest first
        self._orphans: OrderedDict[BlockKey, None] = OrderedDict()  # parent gone, oldest first
        self._parent: dict[BlockKey, BlockKey | None] = {}  # resident key -> its parent key
        # parent key (resident or not) -> its resident children; lets a returning parent
        # re-attach its orphans and a leaving parent orphan its children.
        self._children: dict[BlockKey, set[BlockKey]] = {}

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        if key in self._parent:
            self.access(key)
            return
        if parent == key:
            parent = None
        self._parent[key] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
        if parent is not None and parent not in self._parent:
            self._orphans[key] = None
        else:
            self._lru[key] = None
        for child in self._children.get(key, ()):
            if child in self._orphans:  # its prefix is whole again
                self._reattach(child)

    def _reattach(self, key: BlockKey) -> None:
        """Back into the LRU order, at the old end (it sat idle while orphaned); its own
        orphaned children become reachable too. Iterative: chains can be long."""
        stack = [key]
        while stack:
            k = stack.pop()
            del self._orphans[k]
            self._lru[k] = None
            self._lru.move_to_end(k, last=False)
            stack.extend(c for c in self._children.get(k, ()) if c in self._orphans)

    def access(self, key: BlockKey) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key not in self._parent:
            return
        parent = self._parent.pop(key)
        if self._lru.pop(key, _MISSING) is _MISSING:
            self._orphans.pop(key, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[parent]
        # Direct children become orphans now; deeper descendants follow when their own
        # parent (an orphan, so an early victim) is evicted: one eviction touches only its
        # fan-out, never the whole subtree.
        for child in self._children.get(key, ()):
            if self._lru.pop(child, _MISSING) is not _MISSING:
                self._orphans[child] = None

    def victims(self, n: int, evictable: Evictable) -> list[BlockKey]:
        out: list[BlockKey] = []
        if n <= 0:
            return out
        for order in (self._orphans, self._lru):
            for key in order:
                if evictable(key):
                    out.append(key)
                    if len(out) == n:
                        return out
        return out

    def __len__(self) -> int:
        return len(self._parent)

    def __contains__(self, key: object) -> bool:
        return key in self._parent

    def keys(self) -> Iterable[BlockKey]:
        return iter(self._parent)

    def orphan_count(self) -> int:
        """Resident blocks that cannot be hit now (for stats and tests)."""
        return len(self._orphans)


_MISSING = object()

register_policy("prefix_lru", PrefixLRUPolicy)
