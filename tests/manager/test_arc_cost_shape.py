"""The fast ARC (one node pool, inline batch steps) keeps ARC's exact behaviour: random
inserts, hits, victims with pinned keys and removals, single and batched, against a plain
OrderedDict ARC with the same rules (issue 15.3 changed the data structure, not the policy)."""

from __future__ import annotations

import random

import pytest

from kvtier.manager.policies.arc import ARCPolicy

from ref_arc import RefARC  # tests/manager/ref_arc.py


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


@pytest.mark.parametrize("seed", range(4))
def test_arc_request_shaped_runs_match_reference(seed: int) -> None:
    """The request path's shape, by handle: batches of new keys that take B1's oldest ghosts
    over in long runs, and the tier's victims removed as runs from T1's and T2's LRU ends,
    both spliced whole. Runs broken mid-batch (a ghost or resident key among the new ones,
    victims removed out of order, an invalidated key) must leave the lists as one-by-one
    steps would."""
    from kvtier.manager.policies.arc import _B1, _B2, _T1, _T2

    rng = random.Random(seed)
    c, batch = 48, 12
    arc, ref = ARCPolicy(c), RefARC(c)
    handle: dict[int, int] = {}
    free = list(range(c))
    fresh = 0
    for step in range(600):
        want = min(batch, len(free))
        keys: list[int] = []
        for _ in range(want):
            r = rng.random()
            if r < 0.08 and ref.b1:  # a ghost hit breaks a takeover run
                x = rng.choice(list(ref.b1))
            elif r < 0.12 and ref.b2:
                x = rng.choice(list(ref.b2))
            else:
                x, fresh = fresh, fresh + 1
            if x not in keys:
                keys.append(x)
        if rng.random() < 0.2 and handle:  # a resident key (a hit) amid the new ones
            keys.insert(rng.randrange(len(keys) + 1), rng.choice(sorted(handle)))
        new = [x for x in keys if x not in handle]
        hs = [free.pop() for _ in new]
        handle.update(zip(new, hs))
        arc.insert_at(keys, [handle[x] for x in keys])
        for x in keys:
            ref.insert(x)
        hits = rng.sample(sorted(handle), min(4, len(handle)))
        arc.access_at(hits, [handle[x] for x in hits])
        for x in hits:
            ref.access(x)
        victims, vh = arc.victims_at(rng.randint(1, batch))
        assert victims == ref.victims(len(victims))
        if rng.random() < 0.25:  # out of order: the runs end early
            order = list(range(len(victims)))
            rng.shuffle(order)
            victims, vh = [victims[i] for i in order], [vh[i] for i in order]
        if rng.random() < 0.15 and handle:  # an invalidation among them
            x = rng.choice(sorted(handle))
            if x not in victims:
                victims.append(x)
                vh.append(handle[x])
        arc.remove_at(victims, vh)
        for x in victims:
            ref.remove(x)
            free.append(handle.pop(x))
        got = [list(arc._walk(w)) for w in (_T1, _T2, _B1, _B2)], arc.p
        assert got == ref.lists(), (seed, step)
