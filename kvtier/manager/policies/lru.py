"""Least-recently-used eviction on a :class:`KeyedList`: O(1) per operation, and no pause
proportional to the cache size (an ``OrderedDict`` of 1M keys rebuilds its table in one
request every ~0.5M inserts)."""

from __future__ import annotations

from array import array
from typing import Iterable

from kvtier.manager.index.keyed_list import KeyedList
from kvtier.manager.policies.base import EvictionPolicy, Evictable, register_policy
from kvtier.manager.specs import BlockKey


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity_blocks: int, handle_limit: int | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self._order = KeyedList(capacity_blocks)  # oldest first
        # handle -> the list node of the key holding it (``insert_at``): ``access_at`` reads
        # an array instead of looking the key up. Handles are < ``handle_limit`` (a tier whose
        # handles start past 0: a region of the host tier's pool)
        self.handle_limit = max(capacity_blocks, handle_limit or 0)
        self._node_of = array("i", bytes(4 * self.handle_limit))

    # The list's value of a key is the tier handle ``insert_at`` gave it (-1: none).
    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self._order.push(key, -1)

    def insert_many(self, keys, parents=None) -> None:
        push = self._order.push
        for key in keys:
            push(key, -1)

    def insert_at(self, keys, handles, parents=None) -> None:
        push, node_of = self._order.push, self._node_of
        for key, h in zip(keys, handles):
            node_of[h] = push(key, h)

    def access_at(self, keys, handles) -> None:
        node_of = self._node_of
        self._order.move_nodes_to_end([node_of[h] for h in handles])

    def victims_at(self, n: int):
        keys: list[BlockKey] = []
        handles: list[int] = []
        if n > 0:
            for key, h in self._order.items():
                keys.append(key)
                handles.append(h)
                if len(keys) == n:
                    break
        return keys, handles

    def order_at(self):
        return self._order.items()

    def remove_many(self, keys) -> None:
        pop = self._order.pop
        for key in keys:
            pop(key)

    def access(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def access_many(self, keys) -> None:
        self._order.move_many_to_end(keys)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key)

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
