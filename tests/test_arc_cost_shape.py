"""The fast ARC (one node pool, inline batch steps) keeps ARC's exact behaviour: random
inserts, hits, victims with pinned keys and removals, single and batched, against a plain
OrderedDict ARC with the same rules (issue 15.3 changed the data structure, not the policy)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ref_arc import RefARC  # noqa: E402

from kvtier.manager.policies.arc import ARCPolicy  # noqa: E402


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
