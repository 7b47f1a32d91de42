"""Maps and ordered maps for a million keys with no pause proportional to their size.

The manager's bookkeeping runs on the scheduler's request path, once per block. Plain
``dict``/``OrderedDict`` are O(1) amortised, but at 1M entries two costs land on single
requests: a dict in steady churn (delete one key, insert another) rebuilds its whole table
every ~0.5M inserts (tens of ms at 1M keys), and one Python object per block (an entry record,
an ``OrderedDict`` node value) makes every full garbage collection walk a million objects.

* :class:`KeyShards` spreads keys over many small dicts (about 64 keys each), so a rebuild
  costs microseconds; a few hundred keys per shard still gave millisecond waves when many shards,
  filled together, reached their rebuild point in the same stretch of requests. Shard =
  ``hash(key) % prime``, which keeps the shard choice independent of the low hash bits each
  small dict probes with, also for sequential ints.
* :class:`KeyedList` is an ordered map (an ``OrderedDict`` replacement) with a fixed capacity:
  nodes are slot numbers linked through two ``array`` columns, values live in a third one,
  and ``node -> key`` lives in small dicts of 64 consecutive nodes. Nothing per key is seen
  by the garbage collector: dicts holding only bytes/ints are untracked, whereas a plain list
  of a million keys makes every full collection touch a million scattered objects.
  Nothing is ever reallocated after construction except the small dicts.

Measured figures: docs/design-measurements.md, "kvtier/manager/index/keyed_list.py".
"""

from __future__ import annotations

from array import array
from typing import Hashable, Iterator

SHARD_KEYS = 64  # target keys per shard: its table rebuild costs a few microseconds


def _prime_at_least(n: int) -> int:
    n = max(2, n)
    while True:
        if all(n % d for d in range(2, int(n ** 0.5) + 1)):
            return n
        n += 1


class KeyShards:
    """``key -> int`` spread over many small dicts, sized once for ``expected`` keys (more
    still work, in bigger shards). Owners index ``shards[hash(key) % n]`` inline on their hot
    paths (a method call per lookup costs as much as the lookup) and keep their own count."""

    __slots__ = ("shards", "n")

    def __init__(self, expected: int) -> None:
        self.n = _prime_at_least(expected // SHARD_KEYS) if expected > 2 * SHARD_KEYS else 1
        self.shards: list[dict] = [{} for _ in range(self.n)]

    def keys(self) -> Iterator[Hashable]:
        for shard in self.shards:
            yield from shard

    def values(self) -> Iterator[int]:
        for shard in self.shards:
            yield from shard.values()

    def items(self) -> Iterator[tuple[Hashable, int]]:
        for shard in self.shards:
            yield from shard.items()


class KeyedList:
    """Ordered ``key -> int`` map of at most ``capacity`` keys: O(1) push to the end, move to
    the end, pop of any key and of the first key; iteration oldest first.

    ``push`` on a full list raises; ``push_bounded`` first drops the oldest key (a bounded
    FIFO/LRU history). Do not mutate the list while iterating it. Shard lookups and link
    updates are written out inline rather than in helpers: this class sits on every block's
    request path, where a Python call costs as much as the work it would wrap.
    """

    # ``size`` is the number of keys (an attribute, so hot callers skip a ``len()`` call).
    __slots__ = ("capacity", "_kshards", "_kn", "_nodes", "_vals", "_prev", "_next",
                 "_free", "_nil", "size")
    # Free nodes are chained through ``_next`` too (``_free`` is the first, ``_nil`` ends it),
    # so an empty list of a million nodes costs its arrays and nothing else. ``node -> key``
    # lives in dicts of 64 consecutive nodes (``_nodes[node >> 6]``).

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"KeyedList capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        nil = self._nil = capacity  # sentinel node: _next[nil] is the first, _prev[nil] the last
        index = KeyShards(capacity)  # key -> node
        self._kshards, self._kn = index.shards, index.n
        self._nodes: list[dict] = [{} for _ in range((capacity >> 6) + 1)]
        self._vals = array("q", bytes(8 * capacity))
        self._prev = array("i", [nil]) * (capacity + 1)
        self._next = array("i", range(1, capacity + 2))
        self._next[nil] = nil
        self._free = 0
        self.size = 0

    # -- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: object) -> bool:
        return key in self._kshards[hash(key) % self._kn]

    def __bool__(self) -> bool:
        return self.size > 0

    def get(self, key: Hashable, default: int | None = None) -> int | None:
        node = self._kshards[hash(key) % self._kn].get(key)
        return default if node is None else self._vals[node]

    def first(self) -> tuple[Hashable, int] | None:
        node = self._next[self._nil]
        return None if node == self._nil else (self._nodes[node >> 6][node], self._vals[node])

    def __iter__(self) -> Iterator[Hashable]:
        nxt, nodes, nil = self._next, self._nodes, self._nil
        node = nxt[nil]
        while node != nil:
            yield nodes[node >> 6][node]
            node = nxt[node]

    def items(self) -> Iterator[tuple[Hashable, int]]:
        nxt, nodes, vals, nil = self._next, self._nodes, self._vals, self._nil
        node = nxt[nil]
        while node != nil:
            yield nodes[node >> 6][node], vals[node]
            node = nxt[node]

    # -- writing ------------------------------------------------------------------------------
    def push(self, key: Hashable, value: int = 0) -> int:
        """Set ``key`` to ``value`` and make it the newest; returns its node (the same for as
        long as the key stays, for ``move_nodes_to_end``)."""
        shard = self._kshards[hash(key) % self._kn]
        prev, nxt, nil = self._prev, self._next, self._nil
        free = self._free
        if free == nil and key not in shard:
            raise OverflowError(f"KeyedList is full ({self.capacity} keys)")
        node = shard.setdefault(key, free)  # one probe: find the key or claim the free node
        if node == free and free != nil:
            self._free = nxt[node]
            self._nodes[node >> 6][node] = key
            self.size += 1
        else:  # unlink
            p, n = prev[node], nxt[node]
            nxt[p] = n
            prev[n] = p
        self._vals[node] = value
        last = prev[nil]  # link last
        nxt[last] = node
        prev[node] = last
        nxt[node] = nil
        prev[nil] = node
        return node

    def push_bounded(self, key: Hashable, value: int = 0) -> tuple[Hashable, int] | None:
        """``push``; when full, the oldest key is dropped first and returned with its value."""
        dropped = None
        if self._free == self._nil and key not in self:
            dropped = self.pop_first()
        self.push(key, value)
        return dropped

    def move_to_end(self, key: Hashable) -> bool:
        node = self._kshards[hash(key) % self._kn].get(key)
        if node is None:
            return False
        prev, nxt, nil = self._prev, self._next, self._nil
        p, n = prev[node], nxt[node]
        if n == nil:
            return True  # already the newest
        nxt[p] = n
        prev[n] = p
        last = prev[nil]
        nxt[last] = node
        prev[node] = last
        nxt[node] = nil
        prev[nil] = node
        return True

    def move_many_to_end(self, keys) -> None:
        """``move_to_end`` for each of ``keys`` in order (absent ones ignored), inline."""
        kshards, kn = self._kshards, self._kn
        self.move_nodes_to_end([kshards[hash(key) % kn].get(key) for key in keys])

    def move_nodes_to_end(self, nodes) -> None:
        """``move_many_to_end`` by the nodes ``push`` returned (None: skipped)."""
        prev, nxt, nil = self._prev, self._next, self._nil
        for node in nodes:
            if node is None:
                continue
            n = nxt[node]
            if n == nil:
                continue
            p = prev[node]
            nxt[p] = n
            prev[n] = p
            last = prev[nil]
            nxt[last] = node
            prev[node] = last
            nxt[node] = nil
            prev[nil] = node

    def pop(self, key: Hashable, default: int | None = None) -> int | None:
        node = self._kshards[hash(key) % self._kn].pop(key, None)
        if node is None:
            return default
        return self._release(node)

    def pop_first(self) -> tuple[Hashable, int]:
        node = self._next[self._nil]
        if node == self._nil:
            raise KeyError("pop_first from an empty KeyedList")
        key = self._nodes[node >> 6][node]
        del self._kshards[hash(key) % self._kn][key]
        return key, self._release(node)

    # -- internals ----------------------------------------------------------------------------
    def _release(self, node: int) -> int:
        prev, nxt = self._prev, self._next
        p, n = prev[node], nxt[node]
        nxt[p] = n
        prev[n] = p
        del self._nodes[node >> 6][node]
        nxt[node] = self._free
        self._free = node
        self.size -= 1
        return self._vals[node]
