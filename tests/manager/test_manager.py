"""TieredOffloadingManager: unit behaviour and a hypothesis state machine against a byte model.

The state machine simulates the worker side with dictionaries (slot -> key written there,
disk key -> bytes) so any slot reuse, eviction of a pinned block or read of a block still
being written shows up as *wrong data*, not just as a broken counter.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.manager.admission import SightingThreshold
from kvtier.manager.admission import OffloadLimit
from kvtier.manager.admission.wrappers import StoreThresholdAdmission
from kvtier.manager.events import BlockRemoved, BlockStored
from kvtier.manager.specs import Medium, RequestContext
from kvtier.manager.index.tier_index import BlockState
from kvtier.manager.tiered import TieredOffloadingManager
from support.promotions import is_promotion, settle_promotions


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def store(m, keys, ok=True):
    plan = m.prepare_store(keys)
    m.complete_store(plan.keys, ok)
    return plan


def run_background(m, ok=True):
    for t in m.take_background_transfers():
        m.complete_background(t.id, ok)


def test_store_then_lookup_and_load_from_cpu():
    m = TieredOffloadingManager(cpu_blocks=4)
    keys = [k(0), k(1), k(2)]
    plan = m.prepare_store(keys)
    assert plan.keys == tuple(keys) and len(set(plan.cpu_slots)) == 3
    assert m.lookup(keys).num_hits == 0  # not readable while being written
    m.complete_store(plan.keys)
    assert m.lookup(keys + [k(9)]).tiers == (Medium.CPU,) * 3
    load = m.prepare_load(keys)
    assert load.cpu_slots == plan.cpu_slots and load.sources == ()
    assert load.src.medium is Medium.CPU and load.src.ids == plan.cpu_slots
    assert m.pins() == 3
    m.complete_load(load.keys)
    assert m.pins() == 0
    ev = m.take_events()
    assert any(isinstance(e, BlockStored) and e.medium is Medium.CPU for e in ev)


def test_lru_eviction_order_and_pinned_blocks_survive():
    m = TieredOffloadingManager(cpu_blocks=3)
    store(m, [k(0), k(1), k(2)])
    load = m.prepare_load([k(0)])  # pin 0 (a load is an access: order 1, 2, 0)
    m.touch([k(1), k(2)])  # order 0, 1, 2 with 0 pinned at the cold end
    plan = store(m, [k(3)])
    assert plan.evicted[Medium.CPU] == (k(1),)  # 0 is pinned, 1 is next-oldest
    assert m.lookup([k(0)]).num_hits == 1
    m.complete_load(load.keys)
    plan = store(m, [k(4)])
    assert plan.evicted[Medium.CPU] == (k(0),)  # unpinned now, and the coldest


def test_store_cut_short_when_everything_is_pinned():
    m = TieredOffloadingManager(cpu_blocks=2)
    store(m, [k(0), k(1)])
    load = m.prepare_load([k(0), k(1)])
    plan = m.prepare_store([k(2), k(3)])
    assert plan.keys == () and m.stats.store_skipped_no_space == 2
    m.complete_load(load.keys)
    assert m.pins() == 0


def test_failed_store_frees_its_slot():
    m = TieredOffloadingManager(cpu_blocks=2)
    store(m, [k(0), k(1)], ok=False)
    assert len(m.cpu) == 0 and m.cpu.free_count == 2 and m.stats.failed_stores["CPU"] == 2
    assert m.lookup([k(0)]).num_hits == 0


def test_demotion_to_disk_then_promotion_on_hit():
    m = TieredOffloadingManager(cpu_blocks=2, disk_blocks=8, flush_reserve=2)
    store(m, [k(0), k(1)])
    flushes = m.take_background_transfers()
    assert flushes and flushes[0].dst.medium is Medium.DISK
    assert m.cpu.entries[k(0)].flushing
    for t in flushes:
        m.complete_background(t.id, True)
    plan = store(m, [k(2), k(3)])  # both old blocks are clean now: evicted, kept on disk
    assert set(plan.evicted[Medium.CPU]) == {k(0), k(1)}
    run_background(m)
    found = m.lookup([k(0), k(1)])  # on disk only: promoted first, "not yet"
    assert found.tiers == () and found.pending
    assert m.prepare_load([k(0)]).keys == ()  # nothing READY in CPU memory yet
    [promotion] = m.take_background_transfers()
    assert is_promotion(promotion)
    assert promotion.src.keys == (k(0), k(1)) and promotion.dst.medium is Medium.CPU
    assert m.cpu.entries[k(0)].promoted and m.disk.entries[k(0)].readers == 1
    m.complete_background(promotion.id, True)
    assert m.lookup([k(0)], sighting=False).tiers == (Medium.CPU,)
    load = m.prepare_load([k(0)])
    assert load.keys == (k(0),) and load.sources == (Medium.DISK,)
    assert load.cpu_slots == promotion.dst.ids[:1]  # the slot the promotion filled
    m.complete_load(load.keys)
    assert m.lookup([k(0)]).tiers == (Medium.CPU,) and k(0) in m.disk
    assert m.stats.hit_blocks["DISK"] == 1
    run_background(m)
    assert m.pins() == 0 and m.stats.protocol_errors == 0


def test_failed_disk_load_forgets_the_block():
    m = TieredOffloadingManager(cpu_blocks=1, disk_blocks=4, flush_reserve=1)
    store(m, [k(0)])
    run_background(m)
    store(m, [k(1)])
    run_background(m)
    assert m.lookup([k(0)]).pending
    [promotion] = settle_promotions(m, failed=[k(0)])  # its record is corrupt
    assert promotion.keys == (k(0),)
    assert k(0) not in m.cpu and k(0) not in m.disk  # slot freed, disk block forgotten
    found = m.lookup([k(0)])
    assert found.num_hits == 0 and not found.pending
    assert m.stats.failed_loads == 1
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved) and e.medium is Medium.DISK]
    assert removed and removed[-1].keys == (k(0),)
    run_background(m)  # its DROP: deleted on every rank
    assert m.pins() == 0


def test_failed_demotion_drops_instead_of_retrying():
    m = TieredOffloadingManager(cpu_blocks=1, disk_blocks=4, flush_reserve=1)
    store(m, [k(0)])
    run_background(m, ok=False)
    assert k(0) not in m.disk and m.stats.failed_stores["DISK"] == 1
    plan = store(m, [k(1)])
    assert plan.evicted[Medium.CPU] == (k(0),)
    run_background(m)
    assert m.pins() == 0


def test_disk_restored_from_index_and_capacity_enforced():
    keys = [k(i) for i in range(6)]
    m = TieredOffloadingManager(cpu_blocks=2, disk_blocks=4, initial_disk_keys=keys)
    found = m.lookup(keys)  # the two oldest were over capacity: a miss at once
    assert found.num_hits == 0 and not found.pending
    assert [key in m.disk for key in keys] == [False, False, True, True, True, True]
    drops = m.take_background_transfers()
    assert drops[0].dst.medium is Medium.DROP and set(drops[0].keys) == {k(0), k(1)}
    assert all(not is_promotion(t) for t in drops)
    found = m.lookup(keys[2:])  # restored blocks are hits: promoted as far as CPU room goes
    assert found.pending and found.tiers == ()
    [promotion] = m.take_background_transfers()
    assert is_promotion(promotion) and promotion.keys == (k(2), k(3))
    assert m.stats.load_truncated_no_space == 1
    m.complete_background(promotion.id, True)
    assert m.lookup(keys[2:], sighting=False).tiers == (Medium.CPU,) * 2
    for t in drops:
        m.complete_background(t.id, True)
    assert m.pins() == 0 and m.stats.protocol_errors == 0


def test_protocol_errors_are_counted_not_fatal():
    m = TieredOffloadingManager(cpu_blocks=2)
    m.complete_load([k(5)])
    m.complete_store([k(5)])
    m.complete_background(12345)
    assert m.stats.protocol_errors == 3 and m.pins() == 0


def test_threshold_wrapper_and_offload_limit():
    inner = TieredOffloadingManager(cpu_blocks=8)
    m = StoreThresholdAdmission(inner, threshold=2, max_tracked=100)
    assert m.prepare_store([k(0)]).keys == ()
    m.lookup([k(0)])
    m.lookup([k(0)])
    assert m.prepare_store([k(0)]).keys == (k(0),)
    r = TieredOffloadingManager(cpu_blocks=8, offload_limit=OffloadLimit(0.5))
    ctx = RequestContext(num_prompt_blocks=4, first_block_index=0, block_tokens=16)
    assert r.prepare_store([k(i) for i in range(4)], ctx).keys == (k(0), k(1))
    ctx2 = RequestContext(num_prompt_blocks=4, first_block_index=0, block_tokens=16,
                          offload_ratio=1.0, max_offload_tokens=48)
    assert len(r.prepare_store([k(i) for i in range(10, 14)], ctx2).keys) == 3
    # a later call of the same prompt starts at its first block's index
    ctx3 = RequestContext(num_prompt_blocks=4, first_block_index=1, block_tokens=16)
    assert r.prepare_store([k(i) for i in range(21, 24)], ctx3).keys == (k(21),)
    assert r.prepare_store([k(30)]).keys == (k(30),)  # no context: no limit
    with pytest.raises(ValueError, match="offload_ratio"):
        OffloadLimit(0.0)


def test_sighting_threshold_is_bounded():
    p = SightingThreshold(3, max_tracked=0)
    p.record_lookup([k(i) for i in range(5000)])
    assert len(p._seen) <= 1024


class ManagerMachine(RuleBasedStateMachine):
    """Random interleavings of every operation; the worker side is simulated with bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.m = TieredOffloadingManager(cpu_blocks=4, disk_blocks=6, flush_reserve=2)
        self.slot_data: dict[int, bytes] = {}
        self.disk_data: dict[bytes, bytes] = {}
        self.stores: list = []
        self.loads: list = []

    keys = st.lists(st.integers(0, 11).map(k), min_size=1, max_size=4, unique=True)

    @rule(keys=keys)
    def prepare_store(self, keys):
        plan = self.m.prepare_store(keys)
        assert set(plan.keys) <= set(keys)
        in_flight = {s for p in self.stores for s in p.cpu_slots} | {s for p in self.loads for s in p.cpu_slots}
        in_flight |= {s for t in self.m.background.pending.values() if is_promotion(t)
                      for s in t.dst.ids}
        assert not set(plan.cpu_slots) & in_flight, "slot of an in-flight op handed out again"
        self.stores.append(plan)

    @precondition(lambda self: self.stores)
    @rule(i=st.integers(0, 100), ok=st.booleans())
    def complete_store(self, i, ok):
        plan = self.stores.pop(i % len(self.stores))
        if ok:
            for key, slot in zip(plan.keys, plan.cpu_slots):
                self.slot_data[slot] = key
        self.m.complete_store(plan.keys, ok)

    @rule(keys=keys)
    def load(self, keys):
        """A lookup answers the run READY in CPU memory; blocks on disk after it are promoted
        (background transfers, run by ``background``) and the lookup answers "not yet"."""
        hits = self.m.lookup(keys)
        assert all(t is Medium.CPU for t in hits.tiers)
        if hits.pending:  # a block after the CPU run is being promoted
            assert any(key in self.m.cpu and self.m.cpu.entries[key].promoted
                       for key in keys[hits.num_hits:])
        plan = self.m.prepare_load(keys[: hits.num_hits])
        assert plan.keys == tuple(keys[: hits.num_hits])
        for key, slot in zip(plan.keys, plan.cpu_slots):
            assert self.slot_data.get(slot) == key, "CPU hit points at wrong bytes"
        self.loads.append(plan)

    @precondition(lambda self: self.loads)
    @rule(i=st.integers(0, 100), corrupt=st.booleans(), hop_error=st.booleans())
    def complete_load(self, i, corrupt, hop_error):
        """``corrupt``: the load reports its first key unreadable (the manager forgets it once
        nothing reads it). ``hop_error``: the CPU -> GPU copy raised; that fails no key (the
        CPU bytes are untouched) and every block stays loadable."""
        plan = self.loads.pop(i % len(self.loads))
        failed = list(plan.keys[:1]) if corrupt and not hop_error else []
        for key, slot in zip(plan.keys, plan.cpu_slots):
            assert self.slot_data.get(slot) == key, "a pinned slot was overwritten"
        self.m.complete_load(plan.keys, failed)
        for key in plan.keys:
            e = self.m.cpu.entries.get(key)
            if key in failed:
                assert e is None or e.readers > 0 or e.flushing, "failed key kept unread"
            else:
                assert e is not None and e.state is BlockState.READY, "intact CPU block lost"

    @rule(ok=st.booleans(), corrupt=st.booleans())
    def background(self, ok, corrupt):
        """Demotions, deletions and promotions. A promotion that raised (``not ok``) fails
        every key; ``corrupt``: its first key's record is bad."""
        for t in self.m.take_background_transfers():
            if is_promotion(t):
                failed = list(t.keys[:1]) if corrupt else []
                for key, slot in zip(t.keys, t.dst.ids):
                    entry = self.m.cpu.entries.get(key)
                    assert entry is not None and entry.promoted and entry.slot == slot
                    assert self.m.disk.entries[key].readers > 0, "promoted block unpinned"
                    if not ok or key in failed:
                        self.disk_data.pop(key, None)  # forgotten by the manager
                    else:
                        assert self.disk_data.get(key) == key, "promotion reads wrong bytes"
                        self.slot_data[slot] = key
                self.m.complete_background(t.id, ok, failed)
                for key in t.keys:
                    if not ok or key in failed:
                        assert key not in self.m.cpu and key not in self.m.disk
                    else:
                        assert self.m.cpu.is_ready(key)
                continue
            if t.dst.medium is Medium.DISK:
                for key, slot in zip(t.keys, t.src.ids):
                    assert self.slot_data.get(slot) == key, "flush reads wrong slot"
                    if ok:
                        self.disk_data[key] = key
            else:
                for key in t.keys:
                    self.disk_data.pop(key, None)
            self.m.complete_background(t.id, ok or t.dst.medium is Medium.DROP)

    @rule(keys=keys)
    def touch(self, keys):
        self.m.touch(keys)

    @invariant()
    def capacity_and_slots(self):
        m = self.m
        assert len(m.cpu) <= m.cpu.capacity
        slots = [e.slot for e in m.cpu.entries.values()]
        assert len(slots) == len(set(slots))
        assert len(slots) + len(m.cpu.free_handles()) == m.cpu.capacity
        assert not set(slots) & set(m.cpu.free_handles())
        assert len(m.disk) <= m.disk.capacity
        assert len(m.cpu.policy) == len(m.cpu) and len(m.disk.policy) == len(m.disk)
        for key in (key for p in self.loads for key in p.keys):
            assert key in m.cpu, "block with an in-flight load was evicted"
        for key, e in m.disk.entries.items():
            if e.state is BlockState.READY and not any(key in t.keys for t in m.background.ready):
                assert key in self.disk_data or key in m.writeback.pending_drops or self._pending_flush(key)

    @invariant()
    def promotions_reserve_a_slot_and_pin_the_disk(self):
        m = self.m
        promoting = {key: t for t in m.background.pending.values() if is_promotion(t)
                     for key in t.keys}
        for key in m.cpu.keys():
            e = m.cpu.entries[key]
            if e.promoted:
                assert key in promoting, "promoted block without a promotion in flight"
                assert e.state is not BlockState.READY
                assert m.disk.entries[key].readers > 0, "promoted block's disk copy unpinned"
        for key, t in promoting.items():
            assert m.cpu.entries[key].slot == t.dst.ids[t.keys.index(key)]

    def _pending_flush(self, key):
        return any(t.dst.medium is Medium.DISK and key in t.keys for t in self.m.background.pending.values())

    def teardown(self):
        for plan in self.stores:
            self.m.complete_store(plan.keys, False)
        for plan in self.loads:
            self.m.complete_load(plan.keys)
        while True:
            pending = self.m.take_background_transfers()
            if not pending:
                break
            for t in pending:
                self.m.complete_background(t.id, True)
        assert self.m.pins() == 0, "pin leak"
        assert self.m.stats.protocol_errors == 0


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_policy_names_match_config():
    from kvtier.config import EVICTION_POLICIES
    from kvtier.manager.policies import policy_names

    assert set(EVICTION_POLICIES) <= set(policy_names())


def test_repeated_lookups_of_one_request_count_one_sighting():
    m = StoreThresholdAdmission(TieredOffloadingManager(cpu_blocks=8), threshold=2, max_tracked=100)
    m.lookup([k(0)])
    m.lookup([k(0)], sighting=False)  # the same waiting request asked again
    m.lookup([k(0)], sighting=False)
    assert m.prepare_store([k(0)]).keys == ()
    m.lookup([k(0)])  # a second request
    assert m.prepare_store([k(0)]).keys == (k(0),)


def test_slots_freed_together_come_back_in_order():
    """An evicted run of neighbouring CPU slots is handed out again ascending, so a store that
    replaces it gets one contiguous run (a load of it: one strided DMA per layer, not one copy
    per block). Pushed one by one onto the free chain they came back descending."""
    m = TieredOffloadingManager(cpu_blocks=16, disk_blocks=0)
    first = [bytes([1, i]) for i in range(16)]
    m.complete_store(m.prepare_store(first, RequestContext(request_id="a")).keys)
    second = [bytes([2, i]) for i in range(8)]
    plan = m.prepare_store(second, RequestContext(request_id="b"))  # evicts the 8 oldest
    assert list(plan.keys) == second
    assert list(plan.cpu_slots) == list(range(8))


def test_slots_of_a_request_evicted_tail_first_come_back_ascending():
    """A request's blocks are evicted tail first once it was read (a prefix outlives its
    extensions), so the victims' slots arrive descending; the next store must still get them
    ascending. Handed out in eviction order, every block of a 32k hit was its own copy after
    the tier had filled once (~150 ms instead of ~107 on the H100)."""
    m = TieredOffloadingManager(cpu_blocks=16, disk_blocks=0)
    first = [bytes([1, i]) for i in range(16)]
    m.complete_store(m.prepare_store(first, RequestContext(request_id="a")).keys)
    hit = m.prepare_load(first[:m.lookup(first).num_hits])
    m.complete_load(hit.keys)  # read: its tail is now the coldest
    second = [bytes([2, i]) for i in range(8)]
    plan = m.prepare_store(second, RequestContext(request_id="b"))
    assert set(plan.evicted[Medium.CPU]) == set(first[8:])  # the tail went
    assert list(plan.cpu_slots) == list(range(8, 16))
