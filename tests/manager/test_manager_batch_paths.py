"""The batch paths the request path takes (issue 15: ARC's cost per block) do exactly what the
per-key calls they replace did: ``access_many`` is ``access`` per resident key, a refused
``add_many`` changes nothing, the admit-everything store path plans what the per-key admission
loop plans, and batch admission hooks reach per-key ones."""

from __future__ import annotations

import random

import pytest

from kvtier.manager.admission.base import AdmissionPolicy, AdmitAll
from kvtier.manager.policies import make_policy, policy_names
from kvtier.manager.policies.base import EvictionPolicy
from kvtier.manager.specs import Medium, RequestContext
from kvtier.manager.index.tier_index import BlockState, TierIndex
from kvtier.manager.tiered import TieredOffloadingManager

from ref_arc import RefARC  # tests/manager/ref_arc.py


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def _state(policy: EvictionPolicy) -> tuple:
    out = (list(policy.keys()), policy.victims(len(policy), lambda _k: True))
    return out + ((policy.p, policy.ghost_size()) if hasattr(policy, "ghost_size") else ())


@pytest.mark.parametrize("name", policy_names())
def test_access_many_is_access_per_resident_key(name):
    rng = random.Random(7)
    one, many = make_policy(name, 64), make_policy(name, 64)
    for step in range(400):
        key = k(rng.randrange(200))
        for p in (one, many):  # same inserts and evictions (ghosts too, for ARC)
            if key not in p:
                if len(p) >= 64:
                    p.remove(p.victims(1, lambda _k: True)[0])
                p.insert(key)
        batch = [k(rng.randrange(200)) for _ in range(rng.randrange(1, 12))]  # some absent
        for key in batch:
            if key in one:
                one.access(key)
        many.access_many(batch)
        assert _state(one) == _state(many), step


@pytest.mark.parametrize("name", policy_names())
def test_handle_addressed_calls_are_the_key_calls(name):
    """``insert_at`` / ``access_at`` / ``remove_at`` (the tier's calls, by handle) leave the
    policy as ``insert_many`` / ``access_many`` / ``remove_many`` do."""
    rng = random.Random(11)
    by_key, by_handle = make_policy(name, 32), make_policy(name, 32)
    handle: dict[bytes, int] = {}
    free = list(range(32))
    for step in range(300):
        new = [key for key in dict.fromkeys(k(rng.randrange(90)) for _ in range(3))
               if key not in by_key][: len(free) - 4 if len(free) > 4 else 0]
        if not new:  # full: evict a few
            gone = by_key.victims(4, lambda _k: True)
            by_key.remove_many(gone)
            by_handle.remove_at(gone, [handle[g] for g in gone])
            free += [handle.pop(g) for g in gone]
            continue
        hs = [free.pop() for _ in new]
        handle.update(zip(new, hs))
        by_key.insert_many(new)
        by_handle.insert_at(new, hs)
        used = rng.sample(sorted(handle), min(len(handle), 5))
        by_key.access_many(used)
        by_handle.access_at(used, [handle[u] for u in used])
        assert _state(by_key) == _state(by_handle), step


def test_refused_add_many_changes_nothing():
    ix = TierIndex(Medium.CPU, 8, make_policy("arc", 8), True)
    ix.add_many([k(0), k(1)], BlockState.READY)
    before = (sorted(ix.entries), ix.free_handles(), list(ix.policy.keys()), len(ix))
    for batch in ([k(5), k(6), k(1), k(7)], [k(5), k(6), k(5)]):  # present / twice in batch
        with pytest.raises(KeyError):
            ix.add_many(batch, BlockState.WRITING)
        assert (sorted(ix.entries), ix.free_handles(), list(ix.policy.keys()), len(ix)) == before
    assert ix.add_many([k(5), k(6)], BlockState.WRITING) == before[1][:2]


class _AdmitAllSlowly(AdmissionPolicy):
    """Admits everything through the per-key loop (``admits_everything`` is False)."""

    def admit(self, key):
        return True


def test_admit_everything_store_path_plans_what_the_admission_loop_plans():
    rng = random.Random(3)
    fast = TieredOffloadingManager(cpu_blocks=32, cpu_eviction="arc")
    slow = TieredOffloadingManager(cpu_blocks=32, cpu_eviction="arc",
                                   cpu_admission=_AdmitAllSlowly())
    assert fast.cpu_admission.admits_everything and not slow.cpu_admission.admits_everything
    for _ in range(300):
        keys = [k(rng.randrange(80)) for _ in range(rng.randrange(1, 10))]  # dups, resident
        plans = [m.prepare_store(keys) for m in (fast, slow)]
        assert plans[0] == plans[1]
        for m in (fast, slow):
            m.complete_store(plans[0].keys)
            hits = [key for key in keys if key in m.cpu][:4]
            m.touch(hits)
            m.complete_load(m.prepare_load(hits).keys)
        assert list(fast.cpu.policy.keys()) == list(slow.cpu.policy.keys())
        assert ([(type(e), e.medium, e.keys) for e in fast.take_events()]
                == [(type(e), e.medium, e.keys) for e in slow.take_events()])


class _ParentsSeen(EvictionPolicy):
    """LRU that records the parents it is given."""

    wants_parents = True

    def __init__(self):
        self.inner, self.parents = make_policy("lru", 16), []

    def insert(self, key, parent=None):
        self.parents.append((key, parent))
        self.inner.insert(key)

    def access(self, key):
        self.inner.access(key)

    def remove(self, key):
        self.inner.remove(key)

    def victims(self, n, evictable):
        return self.inner.victims(n, evictable)

    def __len__(self):
        return len(self.inner)

    def __contains__(self, key):
        return key in self.inner


def test_parents_reach_a_policy_that_wants_them():
    m = TieredOffloadingManager(cpu_blocks=16)
    m.cpu.policy = seen = _ParentsSeen()
    m.complete_store(m.prepare_store([k(1), k(2)]).keys)
    m.prepare_store([k(1), k(2), k(3), k(4)], RequestContext(request_id="r", parent_key=k(0)))
    assert seen.parents == [(k(1), None), (k(2), k(1)), (k(3), k(2)), (k(4), k(3))]


class _Counting(AdmissionPolicy):
    def __init__(self):
        self.hits, self.evicts = [], []

    def on_hit(self, key):
        self.hits.append(key)

    def on_evict(self, key):
        self.evicts.append(key)

    def admit(self, key):
        return True


def test_batch_admission_hooks_reach_the_per_key_ones():
    adm = _Counting()
    m = TieredOffloadingManager(cpu_blocks=4, cpu_admission=adm)
    m.complete_store(m.prepare_store([k(i) for i in range(4)]).keys)
    m.complete_load(m.prepare_load([k(0), k(1)]).keys)
    m.complete_store(m.prepare_store([k(8), k(9)]).keys)
    assert adm.hits == [k(0), k(1)] and adm.evicts == [k(2), k(3)]
    assert isinstance(m, TieredOffloadingManager) and not isinstance(adm, AdmitAll)


def test_pooled_arc_follows_the_reference_arc():
    """Batches by handle (the tier's calls) on the pooled ARC, key by key on the reference:
    the same four lists in the same order and the same target after every step."""
    from kvtier.manager.policies.arc import _B1, _B2, _T1, _T2

    rng = random.Random(5)
    c = 24
    arc, ref = make_policy("arc", c), RefARC(c)
    handle: dict[bytes, int] = {}
    free = list(range(c))
    for step in range(3000):
        if len(free) < 4 or rng.random() < 0.3:
            n = rng.randrange(1, 6)
            keys, hs = arc.victims_at(n)
            assert keys == ref.victims(n) and hs == [handle[x] for x in keys]
            arc.remove_at(keys, hs)
            for x in keys:
                ref.remove(x)
                free.append(handle.pop(x))
        else:  # new keys, ghosts among them; a resident one now and then
            pool = [k(rng.randrange(4 * c)) for _ in range(rng.randrange(1, 5))]
            new = [x for x in dict.fromkeys(pool) if x not in handle][: len(free)]
            hs = [free.pop() for _ in new]
            handle.update(zip(new, hs))
            arc.insert_at(new, hs)
            for x in new:
                ref.insert(x)
            hits = rng.sample(sorted(handle), min(3, len(handle)))
            arc.access_at(hits, [handle[x] for x in hits])
            for x in hits:
                ref.access(x)
        got = [list(arc._walk(w)) for w in (_T1, _T2, _B1, _B2)], arc.p
        assert got == ref.lists(), step


@pytest.mark.parametrize("name", policy_names())
def test_tier_victims_step_over_pinned_blocks_by_handle(name):
    """The tier takes the policy's unfiltered victims (``victims_at``) only when none of
    them is pinned; otherwise it walks with its filter."""
    ix = TierIndex(Medium.CPU, 8, make_policy(name, 8), True)
    ix.add_many([k(i) for i in range(8)], BlockState.READY)
    assert ix.victims(3) == [k(0), k(1), k(2)]
    ix.get(k(1)).readers = 1  # a load reads it
    ix.get(k(3)).flushing = True  # a demotion reads it
    ix.get(k(4)).state = BlockState.WRITING
    assert ix.victims(3) == [k(0), k(2), k(5)]
