"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) as an eviction plug-in.

ARC keeps two resident lists, T1 (seen once recently) and T2 (seen at least twice), and two
ghost lists B1/B2 of keys recently evicted from each. A re-inserted key found in a ghost list
tells which list was too small, and the target size ``p`` of T1 moves towards it. This makes
ARC resistant to one-time scans (they only churn T1) while still following recency shifts.

In kvtier the manager, not the policy, decides when to evict: ``victims`` only *proposes* keys
following ARC's REPLACE rule, and a key enters a ghost list when ``remove`` is called. Every
operation is O(1) amortised and nothing pauses in proportion to the cache size: the four lists
share one node pool linked through fixed ``array`` columns, with ``key -> node`` in
:class:`KeyShards` (small dicts) as in :class:`KeyedList`; ghost trimming pops each ghost at
most once.
"""

from __future__ import annotations

from array import array
from itertools import repeat
from typing import Iterable, Iterator

from kvtier.manager.keyed_list import KeyShards
from kvtier.manager.policies.base import Evictable, EvictionPolicy, register_policy
from kvtier.manager.specs import BlockKey

_T1, _T2, _B1, _B2 = 0, 1, 2, 3  # list ids, also the sentinel offsets past the node pool


class ARCPolicy(EvictionPolicy):
    name = "arc"

    def __init__(self, capacity_blocks: int) -> None:
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
        # handles are < capacity): an array read instead of a key lookup
        self._node_of = array("i", bytes(4 * c))
        self._handle_of = array("i", [-1]) * n  # node -> that handle (-1: none)
        self._no_handle = array("i", [0])  # where insert_many's "no handle" notes go
        self._n1 = self._n2 = self._nb1 = self._nb2 = 0  # sizes of T1, T2, B1, B2

    # -- contract --------------------------------------------------------------------------
    # The batch methods are the request path (one call per request, not per block), with
    # every list operation written out inline: a Python call per step would cost as much as
    # the step. ``insert``/``remove`` run the same code for one key.
    def insert(self, key: BlockKey, parent: BlockKey | None = None) -> None:
        self.insert_many((key,))

    def insert_many(self, keys, parents=None) -> None:
        self._insert(keys, None)

    def insert_at(self, keys, handles, parents=None) -> None:
        self._insert(keys, handles)

    def _insert(self, keys, handles) -> None:
        """``insert`` of each key; with ``handles``, also notes which node each handle's key
        holds, for the ``*_at`` calls (they then skip the key lookup)."""
        if handles is None:  # policy-only use: no handles to note
            handles, node_of = repeat(-1), self._no_handle
        else:
            node_of = self._node_of
        handle_of = self._handle_of
        c = self.capacity
        c2 = 2 * c
        shards, kn, nodes, lst = self._shards, self._kn, self._nodes, self._list
        nxt, prev = self._next, self._prev
        s = self._s
        s1, s2, sb1, sb2 = s, s + 1, s + 2, s + 3
        n1, n2, nb1, nb2, free, p = self._n1, self._n2, self._nb1, self._nb2, self._free, self.p
        for key, h in zip(keys, handles):
            if free < 0 and key not in shards[hash(key) % kn]:
                self._n1, self._n2, self._nb1, self._nb2, self._free, self.p = (
                    n1, n2, nb1, nb2, free, p)
                raise OverflowError(f"ARC directory is full ({c2 + 2} keys)")
            if nb1 and n1 + nb1 >= c:  # a new key would push B1's oldest ghost out: its node
                ghost_node = nxt[sb1]
                node = shards[hash(key) % kn].setdefault(key, ghost_node)
                ghost = nodes[ghost_node >> 6][ghost_node]
                if node == ghost_node and ghost != key:  # new: takes the ghost's node over
                    b = nxt[node]
                    nxt[sb1] = b
                    prev[b] = sb1
                    del shards[hash(ghost) % kn][ghost]
                    nodes[node >> 6][node] = key
                    node_of[h] = node
                    handle_of[node] = h
                    lst[node] = _T1
                    last = prev[s1]
                    nxt[last] = node
                    prev[node] = last
                    nxt[node] = s1
                    prev[s1] = node
                    n1 += 1
                    nb1 -= 1
                    continue  # one in, one out: both ghost bounds stay as they were
            else:
                node = shards[hash(key) % kn].setdefault(key, free)  # find, or claim free
            node_of[h] = node
            handle_of[node] = h
            if node == free:  # new: the MRU end of T1
                free = nxt[node]
                nodes[node >> 6][node] = key
                lst[node] = _T1
                last = prev[s1]
                nxt[last] = node
                prev[node] = last
                nxt[node] = s1
                prev[s1] = node
                n1 += 1
            else:
                where = lst[node]
                if where == _T2:  # resident, frequent: to T2's MRU end
                    if nxt[node] != s2:
                        a, b = prev[node], nxt[node]
                        nxt[a] = b
                        prev[b] = a
                        last = prev[s2]
                        nxt[last] = node
                        prev[node] = last
                        nxt[node] = s2
                        prev[s2] = node
                    continue
                if where == _T1:  # resident, second use: T1 -> T2
                    n1 -= 1
                elif where == _B1:  # T1 was too small: grow its target
                    nb1 -= 1
                    p = min(float(c), p + max(nb2 / (nb1 + 1), 1.0))
                else:  # B2: T2 was too small: shrink T1's target
                    nb2 -= 1
                    p = max(0.0, p - max(nb1 / (nb2 + 1), 1.0))
                a, b = prev[node], nxt[node]
                nxt[a] = b
                prev[b] = a
                last = prev[s2]
                nxt[last] = node
                prev[node] = last
                nxt[node] = s2
                prev[s2] = node
                lst[node] = _T2
                n2 += 1
                if where == _T1:
                    continue  # a hit: no ghost bound moved
            # Ghost bounds |T1|+|B1| <= c, |T1|+|T2|+|B1|+|B2| <= 2c: drop the oldest ghosts.
            while nb1 and n1 + nb1 > c:
                node = nxt[sb1]
                b = nxt[node]
                nxt[sb1] = b
                prev[b] = sb1
                ghost = nodes[node >> 6].pop(node)
                del shards[hash(ghost) % kn][ghost]
                nxt[node] = free
                free = node
                nb1 -= 1
            while nb2 and n1 + n2 + nb1 + nb2 > c2:
                node = nxt[sb2]
                b = nxt[node]
                nxt[sb2] = b
                prev[b] = sb2
                ghost = nodes[node >> 6].pop(node)
                del shards[hash(ghost) % kn][ghost]
                nxt[node] = free
                free = node
                nb2 -= 1
            while nb1 and n1 + n2 + nb1 + nb2 > c2:
                node = nxt[sb1]
                b = nxt[node]
                nxt[sb1] = b
                prev[b] = sb1
                ghost = nodes[node >> 6].pop(node)
                del shards[hash(ghost) % kn][ghost]
                nxt[node] = free
                free = node
                nb1 -= 1
        self._n1, self._n2, self._nb1, self._nb2, self._free, self.p = n1, n2, nb1, nb2, free, p

    def access(self, key: BlockKey) -> None:
        node = self._shards[hash(key) % self._kn].get(key)
        if node is None:
            return
        lst = self._list
        where = lst[node]
        if where > _T2:
            return  # a ghost is not resident
        nxt, prev = self._next, self._prev
        s2 = self._s + 1
        a, b = prev[node], nxt[node]
        if b == s2:
            return  # already T2's MRU
        nxt[a] = b
        prev[b] = a
        last = prev[s2]
        nxt[last] = node
        prev[node] = last
        nxt[node] = s2
        prev[s2] = node
        if where == _T1:
            lst[node] = _T2
            self._n1 -= 1
            self._n2 += 1

    def access_many(self, keys) -> None:
        """``access`` for a batch (a request's hits), inline."""
        shards, kn = self._shards, self._kn
        self._access([shards[hash(key) % kn].get(key) for key in keys])

    def access_at(self, keys, handles) -> None:
        node_of = self._node_of
        self._access([node_of[h] for h in handles])

    def _access(self, found) -> None:
        lst, nxt, prev = self._list, self._next, self._prev
        s2 = self._s + 1
        moved = 0  # T1 -> T2
        for node in found:
            if node is None:
                continue
            where = lst[node]
            if where > _T2:
                continue  # a ghost is not resident
            b = nxt[node]
            if b == s2:
                continue  # already T2's MRU
            a = prev[node]
            nxt[a] = b
            prev[b] = a
            last = prev[s2]
            nxt[last] = node
            prev[node] = last
            nxt[node] = s2
            prev[s2] = node
            if where == _T1:
                lst[node] = _T2
                moved += 1
        self._n1 -= moved
        self._n2 += moved

    def remove(self, key: BlockKey) -> None:
        self.remove_many((key,))

    def remove_many(self, keys) -> None:
        shards, kn = self._shards, self._kn
        self._remove([shards[hash(key) % kn].get(key) for key in keys])

    def remove_at(self, keys, handles) -> None:
        node_of = self._node_of
        self._remove([node_of[h] for h in handles])

    def _remove(self, found) -> None:
        """Resident nodes in ``found`` (None: an unknown key) move to their ghost list."""
        lst, nxt, prev = self._list, self._next, self._prev
        sb1 = self._s + 2
        sb2 = sb1 + 1
        n1, n2, nb1, nb2 = self._n1, self._n2, self._nb1, self._nb2
        for node in found:
            if node is None:
                continue
            where = lst[node]
            if where == _T1:  # into B1
                n1 -= 1
                nb1 += 1
                lst[node] = _B1
                to = sb1
            elif where == _T2:  # into B2
                n2 -= 1
                nb2 += 1
                lst[node] = _B2
                to = sb2
            else:
                continue  # a ghost is not resident
            a, b = prev[node], nxt[node]
            nxt[a] = b
            prev[b] = a
            last = prev[to]
            nxt[last] = node
            prev[node] = last
            nxt[node] = to
            prev[to] = node
        self._n1, self._n2, self._nb1, self._nb2 = n1, n2, nb1, nb2
        # A resident key turned ghost leaves |T1|+|B1| and |T1|+|T2|+|B1|+|B2| as they were,
        # so the ghost bounds that ``_insert`` keeps still hold: nothing to trim here.

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


register_policy("arc", ARCPolicy)
