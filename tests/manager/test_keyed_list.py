"""KeyedList / KeyShards: an OrderedDict replacement that never pauses in proportion to its size.

The behaviour is checked against ``OrderedDict`` as a model; the structural promise (no garbage
collected container per block, no container whose traversal touches every block) is checked on
a whole manager, since that is what makes a full collection cost milliseconds instead of 100+.
"""

from __future__ import annotations

import gc
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.manager.admission import make_admission
from kvtier.manager.index.keyed_list import SHARD_KEYS, KeyedList, KeyShards
from kvtier.manager.tiered import TieredOffloadingManager

CAP = 8
keys = st.one_of(st.integers(0, 20), st.integers(0, 20).map(lambda i: b"k%d" % i))


class KeyedListMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kl = KeyedList(CAP)
        self.model: OrderedDict = OrderedDict()

    @rule(key=keys, value=st.integers(-(2**40), 2**40))
    def push(self, key, value):
        if key not in self.model and len(self.model) == CAP:
            with pytest.raises(OverflowError):
                self.kl.push(key, value)
            return
        self.kl.push(key, value)
        self.model[key] = value
        self.model.move_to_end(key)

    @rule(key=keys, value=st.integers(0, 100))
    def push_bounded(self, key, value):
        dropped = self.kl.push_bounded(key, value)
        if key not in self.model and len(self.model) == CAP:
            assert dropped == self.model.popitem(last=False)
        else:
            assert dropped is None
        self.model[key] = value
        self.model.move_to_end(key)

    @rule(key=keys)
    def move_to_end(self, key):
        assert self.kl.move_to_end(key) == (key in self.model)
        if key in self.model:
            self.model.move_to_end(key)

    @rule(key=keys)
    def pop(self, key):
        assert self.kl.pop(key) == self.model.pop(key, None)

    @precondition(lambda self: self.model)
    @rule()
    def pop_first(self):
        assert self.kl.pop_first() == self.model.popitem(last=False)

    @invariant()
    def same_content_and_order(self):
        assert len(self.kl) == len(self.model) and bool(self.kl) == bool(self.model)
        assert list(self.kl.items()) == list(self.model.items())
        assert list(self.kl) == list(self.model)
        assert self.kl.first() == (next(iter(self.model.items())) if self.model else None)
        for i in range(21):
            for key in (i, b"k%d" % i):
                assert (key in self.kl) == (key in self.model)
                assert self.kl.get(key, -1) == self.model.get(key, -1)


TestKeyedList = KeyedListMachine.TestCase
TestKeyedList.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_empty_list_errors_and_capacity_validation():
    with pytest.raises(ValueError):
        KeyedList(0)
    kl = KeyedList(3)
    with pytest.raises(KeyError):
        kl.pop_first()
    assert kl.pop(b"x") is None and kl.pop(b"x", 7) == 7 and kl.first() is None


def test_nodes_are_reused_after_churn():
    kl = KeyedList(100)
    for i in range(10_000):  # 100 times the capacity through the list
        kl.push_bounded(i, i)
    assert len(kl) == 100 and list(kl) == list(range(9_900, 10_000))
    assert [kl.get(i) for i in (9_900, 9_999)] == [9_900, 9_999]


def test_shards_spread_sequential_ints_and_hashes():
    n_keys = 200 * SHARD_KEYS
    for make in (lambda i: i, lambda i: i.to_bytes(8, "little") + b"pad"):
        ks = KeyShards(n_keys)
        for i in range(n_keys):
            ks.shards[hash(make(i)) % ks.n][make(i)] = i
        sizes = [len(s) for s in ks.shards]
        assert ks.n > 100 and max(sizes) < 4 * SHARD_KEYS  # no shard grows into a big table
        assert sorted(ks.values()) == list(range(n_keys))


def _largest_tracked_fanout(root) -> int:
    """Most references held by one GC-tracked object reachable from ``root`` (through kvtier
    objects and containers; classes and modules are not followed). A full collection touches
    every referent of every tracked object, so this bounds its cost per object."""
    seen: set[int] = set()
    stack = [root]
    worst = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        refs = gc.get_referents(obj)
        if gc.is_tracked(obj):
            worst = max(worst, len(refs))
        for r in refs:
            if isinstance(r, (dict, list, tuple, set, frozenset)) or (
                    type(r).__module__.startswith("kvtier") and not isinstance(r, type)):
                stack.append(r)
    return worst


@pytest.mark.parametrize("spec", ["lru", "arc", "lru+reuse_gate", "arc+threshold"])
def test_manager_holds_no_per_block_tracked_objects(spec):
    """20k resident blocks in each tier after churn: no tracked object refers to more than a
    few thousand others (the old Entry-per-block dict referred to 20k, an OrderedDict of keys
    as many), and the number of tracked objects does not grow with the blocks."""
    n = 20_000
    eviction, _, admission = spec.partition("+")
    adm = make_admission(admission, threshold=2, capacity_blocks=n) if admission else None
    gc.collect()
    before = len(gc.get_objects())
    m = TieredOffloadingManager(cpu_blocks=n, cpu_eviction=eviction, cpu_admission=adm,
                                disk_blocks=n, disk_eviction=eviction)
    for start in range(0, 3 * n, 1000):
        batch = [i.to_bytes(8, "little") for i in range(start, start + 1000)]
        m.lookup(batch)
        m.lookup(batch)  # seen twice: every admission plug-in writes it
        plan = m.prepare_store(batch)
        m.complete_store(plan.keys)
        for t in m.take_background_transfers():
            m.complete_background(t.id, True)
        m.take_events()
    assert len(m.cpu) == n and len(m.disk) > n // 2
    gc.collect()
    assert len(gc.get_objects()) - before < 5_000
    assert _largest_tracked_fanout(m) < 5_000
