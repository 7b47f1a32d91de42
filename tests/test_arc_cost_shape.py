"""The fast ARC (one node pool, inline batch steps) keeps ARC's exact behaviour: random
inserts, hits, victims with pinned keys and removals, single and batched, against a plain
OrderedDict ARC with the same rules (issue 15.3 changed the data structure, not the policy)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvtier.manager.policies.arc import ARCPolicy


class RefARC:
    """ARC on four OrderedDicts, one key at a time (the rules of kvtier's ARC)."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0.0
        self.t1, self.t2, self.b1, self.b2 = OrderedDict(), OrderedDict(), OrderedDict(), OrderedDict()

    def insert(self, key) -> None:
        if key in self.t1 or key in self.t2:
            self.access(key)
            return
        if key in self.b1:
            del self.b1[key]
            self.p = min(float(self.c), self.p + max(len(self.b2) / (len(self.b1) + 1), 1.0))
            self.t2[key] = None
        elif key in self.b2:
            del self.b2[key]
            self.p = max(0.0, self.p - max(len(self.b1) / (len(self.b2) + 1), 1.0))
            self.t2[key] = None
        else:
            self.t1[key] = None
        self.trim()

    def access(self, key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None
        else:
            return
        self.trim()

    def trim(self) -> None:
        t1, t2, b1, b2, c = self.t1, self.t2, self.b1, self.b2, self.c
        while b1 and len(t1) + len(b1) > c:
            b1.popitem(last=False)
        while b2 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            b2.popitem(last=False)
        while b1 and len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
            b1.popitem(last=False)

    def victims(self, n: int, ok) -> list:
        out: list = []
        it1 = (k for k in self.t1 if ok(k))
        it2 = (k for k in self.t2 if ok(k))
        left = len(self.t1)
        while len(out) < n:
            order = (it1, it2) if left > self.p else (it2, it1)
            key = src = None
            for src in order:
                key = next(src, None)
                if key is not None:
                    break
            if key is None:
                break
            if src is it1:
                left -= 1
            out.append(key)
        return out


@pytest.mark.parametrize("seed", range(12))
def test_arc_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    c = rng.choice([1, 2, 3, 5, 8, 20, 64])
    universe = rng.choice([2, 4, 10]) * c + 2
    ref, arc = RefARC(c), ARCPolicy(c)
    for step in range(2500):
        op = rng.random()
        if op < 0.45:  # a store: new keys while there is room, resident keys any time
            room = c - len(arc)
            keys = []
            for key in dict.fromkeys(rng.randrange(universe) for _ in range(rng.randint(1, 6))):
                if key in arc or room > 0:
                    room -= key not in arc
                    keys.append(key)
            for key in keys:
                ref.insert(key)
            if rng.random() < 0.5:
                arc.insert_many(keys)
            else:
                for key in keys:
                    arc.insert(key)
        elif op < 0.65:
            key = rng.randrange(universe)
            ref.access(key)
            arc.access(key)
        elif op < 0.85:  # evict, with a few pinned keys
            n = rng.randint(0, 6)
            pinned = set(rng.sample(range(universe), min(universe, rng.randint(0, 5))))
            want = ref.victims(n, lambda key: key not in pinned)
            assert arc.victims(n, lambda key: key not in pinned) == want, (seed, step)
            for key in want:
                ref.remove(key)
            if rng.random() < 0.5:
                arc.remove_many(want)
            else:
                for key in want:
                    arc.remove(key)
        else:  # invalidations, ghosts and unknown keys included
            keys = [rng.randrange(universe) for _ in range(3)]
            for key in keys:
                ref.remove(key)
            arc.remove_many(keys)
        assert arc.p == ref.p, (seed, step)
        assert list(arc.keys()) == list(ref.t1) + list(ref.t2), (seed, step)
        assert list(arc._walk(2)) == list(ref.b1) and list(arc._walk(3)) == list(ref.b2)
        assert len(arc) == len(ref.t1) + len(ref.t2)
        assert arc.ghost_size() == len(ref.b1) + len(ref.b2)
    assert all((key in arc) == (key in ref.t1 or key in ref.t2) for key in range(universe))
