"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) as an eviction plug-in.

ARC keeps two resident lists, T1 (seen once recently) and T2 (seen at least twice), and two
ghost lists B1/B2 of keys recently evicted from each. A re-inserted key found in a ghost list
tells which list was too small, and the target size ``p`` of T1 moves towards it. This makes
ARC resistant to one-time scans (they only churn T1) while still following recency shifts.

In kvtier the manager, not the policy, decides when to evict: ``victims`` only *proposes* keys
following ARC's REPLACE rule, and a key enters a ghost list when ``remove`` is called. Every
operation is O(1) amortised and nothing pauses in proportion to the cache size: the four lists
share one node pool linked through fixed ``array`` columns (:class:`ARCLists`, which also holds
the read side: walks and REPLACE's victims); ghost trimming pops each ghost at most once. This
module holds the rules that change the lists, written out inline per batch.
"""

from __future__ import annotations

from itertools import repeat

from kvtier.manager.policies.arc_lists import _B1, _B2, _T1, _T2, ARCLists, _splice
from kvtier.manager.policies.base import EvictionPolicy, register_policy
from kvtier.manager.specs import BlockKey

__all__ = ["ARCPolicy", "_T1", "_T2", "_B1", "_B2"]


class ARCPolicy(ARCLists, EvictionPolicy):
    """ARC's rules on :class:`ARCLists`: what an insert, a hit and a removal do to the lists."""

    name = "arc"

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
        # New keys that take over B1's oldest ghosts form a run from B1's LRU end: its nodes
        # get their new key and list id, and the run is spliced onto T1's MRU end in one step
        # (its inner links stay as they are). Any other step splices the pending run first.
        g1 = gl = gnext = -1  # first / last node of the pending run, B1's oldest ghost past it
        for key, h in zip(keys, handles):
            if free < 0 and key not in shards[hash(key) % kn]:
                if g1 >= 0:  # splice the taken-over ghosts from B1's LRU end onto T1's MRU end
                    _splice(nxt, prev, g1, gl, sb1, s1)
                    g1 = -1
                self._n1, self._n2, self._nb1, self._nb2, self._free, self.p = (
                    n1, n2, nb1, nb2, free, p)
                raise OverflowError(f"ARC directory is full ({c2 + 2} keys)")
            if nb1 and n1 + nb1 >= c:  # a new key would push B1's oldest ghost out: its node
                ghost_node = gnext if g1 >= 0 else nxt[sb1]
                node = shards[hash(key) % kn].setdefault(key, ghost_node)
                ghost = nodes[ghost_node >> 6][ghost_node]
                if node == ghost_node and ghost != key:  # new: takes the ghost's node over
                    gnext = nxt[node]
                    if g1 < 0:
                        g1 = node
                    gl = node
                    del shards[hash(ghost) % kn][ghost]
                    nodes[node >> 6][node] = key
                    node_of[h] = node
                    handle_of[node] = h
                    lst[node] = _T1
                    n1 += 1
                    nb1 -= 1
                    continue  # one in, one out: both ghost bounds stay as they were
            else:
                node = shards[hash(key) % kn].setdefault(key, free)  # find, or claim free
            if g1 >= 0:  # the run ends here: spliced before this key's step
                _splice(nxt, prev, g1, gl, sb1, s1)
                g1 = -1
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
        if g1 >= 0:
            _splice(nxt, prev, g1, gl, sb1, s1)
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
        """Resident nodes in ``found`` (None: an unknown key) move to their ghost list.

        The usual batch is the tier's victims: a run from T1's LRU end and/or one from T2's,
        in order. Such a run is not relinked node by node: its nodes are only marked, and the
        run is spliced onto its ghost list's MRU end in one step (its inner links stay as
        they are), so a victim costs a byte write and one link read. Any other node flushes
        the pending runs first and is relinked on its own, which keeps every list's order
        exactly that of one-by-one removal."""
        lst, nxt, prev = self._list, self._next, self._prev
        s1 = self._s
        s2, sb1, sb2 = s1 + 1, s1 + 2, s1 + 3
        n1, n2, nb1, nb2 = self._n1, self._n2, self._nb1, self._nb2
        f1 = r1 = f2 = r2 = -1  # first / last node of the pending T1 -> B1 and T2 -> B2 runs
        want1, want2 = nxt[s1], nxt[s2]  # the node that would extend each run
        for node in found:
            if node is None:
                continue
            where = lst[node]
            if where == _T1:
                if node == want1:  # T1's LRU end (past the run): joins the run
                    lst[node] = _B1
                    if f1 < 0:
                        f1 = node
                    r1 = node
                    want1 = nxt[node]
                    n1 -= 1
                    nb1 += 1
                    continue
            elif where == _T2:
                if node == want2:
                    lst[node] = _B2
                    if f2 < 0:
                        f2 = node
                    r2 = node
                    want2 = nxt[node]
                    n2 -= 1
                    nb2 += 1
                    continue
            else:
                continue  # a ghost is not resident
            if f1 >= 0:  # splice the pending runs before relinking a node out of order
                _splice(nxt, prev, f1, r1, s1, sb1)
                f1 = -1
            if f2 >= 0:
                _splice(nxt, prev, f2, r2, s2, sb2)
                f2 = -1
            if where == _T1:  # into B1
                n1 -= 1
                nb1 += 1
                lst[node] = _B1
                to = sb1
            else:  # into B2
                n2 -= 1
                nb2 += 1
                lst[node] = _B2
                to = sb2
            a, b = prev[node], nxt[node]
            nxt[a] = b
            prev[b] = a
            last = prev[to]
            nxt[last] = node
            prev[node] = last
            nxt[node] = to
            prev[to] = node
            want1, want2 = nxt[s1], nxt[s2]
        if f1 >= 0:
            _splice(nxt, prev, f1, r1, s1, sb1)
        if f2 >= 0:
            _splice(nxt, prev, f2, r2, s2, sb2)
        self._n1, self._n2, self._nb1, self._nb2 = n1, n2, nb1, nb2
        # A resident key turned ghost leaves |T1|+|B1| and |T1|+|T2|+|B1|+|B2| as they were,
        # so the ghost bounds that ``_insert`` keeps still hold: nothing to trim here.


register_policy("arc", ARCPolicy)
