"""Least-recently-used eviction: an ordered dict, O(1) per operation."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from kvtier.manager.policies.base import EvictionPolicy, Evictable, register_policy
from kvtier.manager.specs import BlockKey


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity_blocks: int = 0) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def victims(self, n: int, evictable: Evictable) -> list[BlockKey]:
        out: list[BlockKey] = []
        if n <= 0:
            return out
        # Pinned keys are rare (in flight); the walk stops as soon as n victims are found.
        for key in self._order:
            if evictable(key):
                out.append(key)
                if len(out) == n:
                    break
        return out

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def keys(self) -> Iterable[BlockKey]:
        return iter(self._order)


register_policy("lru", LRUPolicy)
