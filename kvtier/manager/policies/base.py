"""Eviction policy plug-in contract and registry.

A policy only orders keys; it never decides *whether* a key may go (pins, in-flight state):
the manager passes ``evictable`` and the policy skips what it refuses. Every method must be
O(1) amortised per key: no scan, sort or heap rebuild proportional to the cache size on the
request path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable, Iterator, Sequence

from kvtier.manager.specs import BlockKey

Evictable = Callable[[BlockKey], bool]


class EvictionPolicy(ABC):
    name: str = ""
    # Whether ``insert``'s ``parent`` is used: the manager only works out parents (a dict per
    # store) for a policy that reads them.
    wants_parents: bool = False

    @abstractmethod
    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        """``key`` became resident. ``parent`` is the previous block of its prefix, if known."""

    @abstractmethod
    def access(self, key: BlockKey) -> None:
        """``key`` was hit or touched."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """``key`` left the tier (evicted or invalidated). Unknown keys are ignored."""

    def insert_many(self, keys: Sequence[BlockKey],
                    parents: Sequence[BlockKey | None] | None = None) -> None:
        """``insert`` for a batch, in order (policies may override it to save per-key calls)."""
        for i, key in enumerate(keys):
            self.insert(key, parents[i] if parents is not None else None)

    def remove_many(self, keys: Iterable[BlockKey]) -> None:
        """``remove`` for a batch."""
        for key in keys:
            self.remove(key)

    def access_many(self, keys: Iterable[BlockKey]) -> None:
        """``access`` for a batch, in order; keys not resident are ignored (policies override
        it: on the request path a Python call per key costs as much as the access)."""
        for key in keys:
            if key in self:
                self.access(key)

    # Handle-addressed batches: the tier passes, with the keys, the handle each one holds
    # while resident (its CPU slot; < the tier's capacity, which is the policy's). A policy
    # may keep ``handle -> node`` from ``insert_at`` to skip its own key lookup in
    # ``access_at`` / ``remove_at``; the tier then addresses every resident key through these.
    def insert_at(self, keys: Sequence[BlockKey], handles: Sequence[int],
                  parents: Sequence[BlockKey | None] | None = None) -> None:
        self.insert_many(keys, parents)

    def access_at(self, keys: Sequence[BlockKey], handles: Sequence[int]) -> None:
        self.access_many(keys)

    def remove_at(self, keys: Sequence[BlockKey], handles: Sequence[int]) -> None:
        self.remove_many(keys)

    def victims_at(self, n: int) -> tuple[list[BlockKey], list[int]] | None:
        """The next ``n`` victims as ``victims`` would give them if every key were evictable,
        with the handle each got from ``insert_at`` (-1: none). The tier checks pins by
        handle, with no key lookup, and calls ``victims`` when one is pinned. None: this
        policy keeps no handles (or must see every key: a filter of its own)."""
        return None

    def order_at(self) -> Iterator[tuple[BlockKey, int]] | None:
        """Every resident key, best victim first, with its handle from ``insert_at`` (-1:
        none), lazily: the order ``victims`` walks when every key is evictable. The tier's
        write-back walks (the dirty blocks at the cold end, the clean victims under a lagging
        disk) check each step by handle, with no key lookup and no call back, which makes a
        step ~5x cheaper. None: this policy's walk is not a plain order (or it keeps no
        handles); the tier then walks ``victims`` with a filter. Nothing may change the
        policy while the iterator is in use."""
        return None

    @abstractmethod
    def victims(self, n: int, evictable: Evictable) -> list[BlockKey]:
        """Up to ``n`` resident keys to evict, best victim first, all passing ``evictable``.
        The keys stay resident until ``remove`` is called for them."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def keys(self) -> Iterable[BlockKey]:  # pragma: no cover - optional, for stats/tests
        return ()


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {}


def register_policy(name: str, factory: Callable[..., EvictionPolicy]) -> None:
    """Register ``factory(capacity_blocks[, handle_limit]) -> EvictionPolicy`` under ``name``."""
    _REGISTRY[name] = factory


def make_policy(name: str, capacity_blocks: int, handle_limit: int | None = None) -> EvictionPolicy:
    """The policy ``name`` for ``capacity_blocks`` blocks whose tier handles are below
    ``handle_limit`` (default: the capacity)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; allowed: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory(capacity_blocks) if handle_limit is None else factory(capacity_blocks,
                                                                          handle_limit)


def policy_names() -> list[str]:
    return sorted(_REGISTRY)
