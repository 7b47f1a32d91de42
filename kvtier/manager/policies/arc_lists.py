"""ARC's four lists (T1, T2 and their ghosts B1, B2) on one node pool, and their read side.

The node pool and its links are fixed ``array`` columns and ``key -> node`` is a
:class:`KeyShards` (small dicts), as in :class:`KeyedList`: a million keys are no million
Python objects, and nothing is ever rebuilt in one go. A key keeps its node for its whole stay
in ARC's directory, so moving it between lists is a relink and a byte write. This module holds
the layout and what only reads it: the walks, and the victims ARC's REPLACE rule proposes.
The rules that change the lists (insert, hit, removal into a ghost list) are in
:mod:`kvtier.manager.policies.arc`.
"""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator

from kvtier.manager.index.keyed_list import KeyShards
from kvtier.manager.policies.base import Evictable
from kvtier.manager.specs import BlockKey

_T1, _T2, _B1, _B2 = 0, 1, 2, 3  # list ids, also the sentinel offsets past the node pool


def _splice(nxt, prev, first: int, last: int, src: int, dst: int) -> None:
    """Move the run ``first..last`` (linked, at the LRU end of list ``src``) to the MRU end of
    list ``dst`` (sentinels); the run's inner links stay as they are."""
    b = nxt[last]
    nxt[src] = b
    prev[b] = src
    tail = prev[dst]
    nxt[tail] = first
    prev[first] = tail
    nxt[last] = dst
    prev[dst] = last


class ARCLists:
    """The four lists, the target ``p`` of T1, and the tier-handle <-> node notes."""

    def __init__(self, capacity_blocks: int, handle_limit: int | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        c = self.capacity = capacity_blocks
        self.p = 0.0  # target size of T1
        # One node pool for the four lists. Bounds: the manager keeps |T1|+|T2| <= c and the
        # ghost trimming keeps |T1|+|T2|+|B1|+|B2| <= 2c once each key is handled (2c + 1
        # in between, +1 spare). A key has one node for its whole stay in ARC's directory:
        # moving it between lists (hit, eviction into a ghost list, ghost hit) is a relink
        # and a byte write, not a dict delete + insert.
        n = 2 * c + 2
        index = KeyShards(n)  # key -> node
        self._shards, self._kn = index.shards, index.n
        self._nodes: list[dict] = [{} for _ in range((n >> 6) + 1)]  # node -> key, 64 a dict
        self._list = bytearray(n + 4)  # node -> list id
        s = self._s = n  # sentinel of list id i is node n + i (_next[s] its LRU end)
        self._next = array("i", range(1, n + 5))  # free nodes are chained through _next
        self._next[n - 1] = -1
        self._prev = array("i", bytes(4 * (n + 4)))
        for i in range(4):
            self._next[s + i] = self._prev[s + i] = s + i
        self._free = 0
        # handle -> node of the key holding it, for the ``*_at`` calls of the tier (whose
        # handles are < handle_limit, the capacity unless the tier's handles start past 0):
        # an array read instead of a key lookup
        self.handle_limit = max(c, handle_limit or 0)
        self._node_of = array("i", bytes(4 * self.handle_limit))
        self._handle_of = array("i", [-1]) * n  # node -> that handle (-1: none)
        self._no_handle = array("i", [0])  # where insert_many's "no handle" notes go
        self._n1 = self._n2 = self._nb1 = self._nb2 = 0  # sizes of T1, T2, B1, B2

    def victims(self, n: int, evictable: Evictable) -> list[BlockKey]:
        out: list[BlockKey] = []
        if n <= 0:
            return out
        # REPLACE: take T1's LRU while T1 exceeds its target, else T2's LRU; when the
        # preferred list has nothing evictable left, fall back to the other one. Each list is
        # walked from its LRU end once (pinned keys are rare: a short walk).
        nodes, nxt = self._nodes, self._next
        s1 = self._s
        s2 = s1 + 1
        node1, node2 = nxt[s1], nxt[s2]
        t1_left = self._n1  # T1's size as if the victims so far were already gone
        p = self.p
        append = out.append
        while len(out) < n:
            if t1_left > p:
                while node1 != s1:  # T1 first
                    key = nodes[node1 >> 6][node1]
                    node1 = nxt[node1]
                    if evictable(key):
                        t1_left -= 1
                        append(key)
                        break
                else:
                    while node2 != s2:
                        key = nodes[node2 >> 6][node2]
                        node2 = nxt[node2]
                        if evictable(key):
                            append(key)
                            break
                    else:
                        break
            else:
                while node2 != s2:  # T2 first
                    key = nodes[node2 >> 6][node2]
                    node2 = nxt[node2]
                    if evictable(key):
                        append(key)
                        break
                else:
                    while node1 != s1:
                        key = nodes[node1 >> 6][node1]
                        node1 = nxt[node1]
                        if evictable(key):
                            t1_left -= 1
                            append(key)
                            break
                    else:
                        break
        return out

    def victims_at(self, n: int):
        # REPLACE as in ``victims`` with every key evictable: T1's LRU while T1 exceeds
        # its target (or T2 is empty), else T2's LRU.
        keys: list[BlockKey] = []
        handles: list[int] = []
        nodes, nxt, handle_of = self._nodes, self._next, self._handle_of
        s1 = self._s
        s2 = s1 + 1
        node1, node2 = nxt[s1], nxt[s2]
        t1_left, p = self._n1, self.p
        for _ in range(n):
            if node1 != s1 and (t1_left > p or node2 == s2):
                node, node1 = node1, nxt[node1]
                t1_left -= 1
            elif node2 != s2:
                node, node2 = node2, nxt[node2]
            else:
                break
            keys.append(nodes[node >> 6][node])
            handles.append(handle_of[node])
        return keys, handles

    def __len__(self) -> int:
        return self._n1 + self._n2

    def __contains__(self, key: object) -> bool:
        node = self._shards[hash(key) % self._kn].get(key)
        return node is not None and self._list[node] <= _T2

    def keys(self) -> Iterable[BlockKey]:
        yield from self._walk(_T1)
        yield from self._walk(_T2)

    # -- internals -------------------------------------------------------------------------
    def ghost_size(self) -> int:
        return self._nb1 + self._nb2

    def _walk(self, which: int) -> Iterator[BlockKey]:
        """Keys of one list (T1, T2, B1, B2), LRU first."""
        nodes, nxt = self._nodes, self._next
        s = self._s + which
        node = nxt[s]
        while node != s:
            yield nodes[node >> 6][node]
            node = nxt[node]
