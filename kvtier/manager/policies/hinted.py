"""Eviction that lets hinted blocks outrank unhinted ones (see ``kvtier.manager.hints``).

Wraps any policy: a victim walk passes over blocks hinted *keep* (conversation continues,
priority > 0) and, once the walk is done, gives each of them a second chance (moved to the
policy's most-recent end), so the next walk does not meet them again until they age back to the
front: amortised O(1) per block. At most ``MAX_SKIPS`` kept blocks are passed over per walk, so
a router that marks everything cannot stall an eviction (the walk then takes kept blocks in the
inner policy's order).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from kvtier.manager.hints import KEEP, HintBook
from kvtier.manager.policies.base import EvictionPolicy, Evictable
from kvtier.manager.specs import BlockKey

MAX_SKIPS = 256


class HintedEviction(EvictionPolicy):
    def __init__(self, inner: EvictionPolicy, book: HintBook) -> None:
        self.inner = inner
        self.book = book
        self.name = f"{inner.name}+hints"
        self.wants_parents = inner.wants_parents
        self.second_chances = 0

    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self.inner.insert(key, parent)

    def insert_many(self, keys: Sequence[BlockKey],
                    parents: Sequence[BlockKey | None] | None = None) -> None:
        self.inner.insert_many(keys, parents)

    def access(self, key: BlockKey) -> None:
        self.inner.access(key)

    def access_many(self, keys: Iterable[BlockKey]) -> None:
        self.inner.access_many(keys)

    def insert_at(self, keys, handles, parents=None) -> None:
        self.inner.insert_at(keys, handles, parents)

    def access_at(self, keys, handles) -> None:
        self.inner.access_at(keys, handles)

    def remove_at(self, keys, handles) -> None:
        self.inner.remove_at(keys, handles)

    def remove(self, key: BlockKey) -> None:
        self.inner.remove(key)

    def remove_many(self, keys: Iterable[BlockKey]) -> None:
        self.inner.remove_many(keys)

    def victims_at(self, n: int):
        # with kept blocks in the book, the walk must see every key
        return self.inner.victims_at(n) if not len(self.book) else None

    def order_at(self):
        return self.inner.order_at() if not len(self.book) else None

    def victims(self, n: int, evictable: Evictable) -> list[BlockKey]:
        book = self.book
        if not len(book):
            return self.inner.victims(n, evictable)
        kept: list[BlockKey] = []

        def unhinted_first(key: BlockKey) -> bool:
            if not evictable(key):
                return False
            if len(kept) < MAX_SKIPS and book.rank(key) == KEEP:
                kept.append(key)
                return False
            return True

        out = self.inner.victims(n, unhinted_first)
        if len(out) < n:  # too few unhinted blocks: kept ones go too, in the inner order
            chosen = set(out)
            out += self.inner.victims(n - len(out), lambda k: k not in chosen and evictable(k))
            kept = [k for k in kept if k not in set(out)]
        for key in kept:  # after the walk: the inner policy's order must not change under it
            self.inner.access(key)
        self.second_chances += len(kept)
        return out

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def keys(self) -> Iterable[BlockKey]:
        return self.inner.keys()
