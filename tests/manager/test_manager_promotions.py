"""TieredOffloadingManager: a lookup promotes disk blocks into CPU memory; requests share it.

vLLM #44294: when many requests hit one prefix at once, the disk must be read once and no
request cut short. A lookup that finds blocks on disk only reserves CPU slots for them and
queues ONE DISK -> CPU background transfer; every lookup that reaches those blocks answers
"not yet" (pending) until it settles, and then each request loads the same READY CPU slots.
"""

from __future__ import annotations

import pytest

from kvtier.manager.cost import LoadCostModel
from kvtier.manager.events import BlockAccessed, BlockRemoved, BlockStored
from kvtier.manager.specs import LoadStoreSpec, Medium
from kvtier.manager.tiered import TieredOffloadingManager
from support.promotions import is_promotion, lookup_promoted, settle_promotions

CPU, DISK = Medium.CPU, Medium.DISK


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def on_disk_only(keys, cpu_blocks=2, **kw):
    """A manager where ``keys`` live on disk only (demoted, then evicted from CPU); the CPU
    tier is full of READY, clean filler blocks ``k(100)``, ``k(101)``, ..."""
    m = TieredOffloadingManager(cpu_blocks=cpu_blocks, disk_blocks=16, flush_reserve=cpu_blocks,
                                **kw)
    for key in keys:
        plan = m.prepare_store([key])
        m.complete_store(plan.keys)
        for t in m.take_background_transfers():
            m.complete_background(t.id, True)
    filler = [k(100 + i) for i in range(cpu_blocks)]
    plan = m.prepare_store(filler)
    m.complete_store(plan.keys)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    assert all(key not in m.cpu for key in keys) and all(key in m.disk for key in keys)
    m.take_events()
    return m


def test_two_lookups_share_one_promotion_and_load_the_same_slots():
    m = on_disk_only([k(0), k(1)])
    first = m.lookup([k(0), k(1)])
    assert first.pending and first.tiers == ()
    second = m.lookup([k(0), k(1)])  # another request, same blocks: "not yet" too
    assert second.pending and second.tiers == ()
    [promotion] = m.take_background_transfers()  # ONE disk read for both
    assert is_promotion(promotion)
    assert promotion.src == LoadStoreSpec.disk([k(0), k(1)]) and promotion.keys == (k(0), k(1))
    slots = promotion.dst.ids
    assert promotion.dst.medium is CPU and len(set(slots)) == 2
    assert m.cpu.get(k(0)).promoted and not m.cpu.is_ready(k(0))
    assert m.disk.get(k(0)).readers == 1  # pinned on disk while it is read
    assert m.lookup([k(0), k(1)]).pending  # still in flight: no second promotion
    assert m.take_background_transfers() == []
    assert m.prepare_load([k(0), k(1)]).keys == ()  # nothing READY to load yet
    events = m.take_events()
    assert not [e for e in events if isinstance(e, BlockAccessed)]  # no hit loaded yet
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium is CPU]
    assert sorted(key for e in removed for key in e.keys) == [k(100), k(101)]  # made room

    m.complete_background(promotion.id, True)
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert [(e.medium, e.keys) for e in stored] == [(CPU, (k(0), k(1)))]
    assert m.disk.get(k(0)).readers == 0 and k(0) in m.disk  # the disk copy stays
    a = m.lookup([k(0), k(1)], sighting=False)
    b = m.lookup([k(0), k(1)], sighting=False)
    assert a.tiers == b.tiers == (CPU, CPU) and not a.pending and not b.pending
    pa = m.prepare_load([k(0), k(1)])
    pb = m.prepare_load([k(0), k(1)])
    assert pa.keys == pb.keys == (k(0), k(1))
    assert pa.cpu_slots == pb.cpu_slots == slots  # both read the slots the promotion filled
    assert pa.src == LoadStoreSpec.cpu(slots)
    assert pa.sources == (DISK, DISK)  # the first load counts its hits as disk hits
    assert pb.sources == ()  # the second one reads plain CPU hits
    accessed = [(e.medium, e.keys) for e in m.take_events() if isinstance(e, BlockAccessed)]
    assert accessed == [(DISK, (k(0), k(1))), (CPU, (k(0), k(1)))]  # as hit_blocks counts
    assert m.pins() == 4
    m.complete_load(pa.keys)
    m.complete_load(pb.keys)
    assert m.pins() == 0 and m.stats.protocol_errors == 0
    assert m.stats.hit_blocks["DISK"] == 2 and m.stats.hit_blocks["CPU"] == 2
    assert m.stats.failed_loads == 0 and m.stats.load_truncated_no_space == 0


@pytest.mark.parametrize("how", ["failed_keys", "whole_transfer"])
def test_a_failed_promotion_frees_its_slot_and_forgets_the_disk_block(how):
    m = on_disk_only([k(0), k(1)], cpu_blocks=2)
    assert m.lookup([k(0), k(1)]).pending
    assert m.lookup([k(0), k(1)]).pending  # a second request waits for the same promotion
    [promotion] = m.take_background_transfers()
    slots = set(promotion.dst.ids)
    m.take_events()
    if how == "failed_keys":  # k(0)'s record is corrupt: the whole hit ends there
        m.complete_background(promotion.id, True, failed=[k(0)])
        bad, good = [k(0)], [k(1)]
    else:  # the read raised: every key of it failed
        m.complete_background(promotion.id, False)
        bad, good = [k(0), k(1)], []
    for key in bad:
        assert key not in m.cpu and key not in m.disk  # slot freed, disk block forgotten
    events = m.take_events()
    removed = [key for e in events if isinstance(e, BlockRemoved) and e.medium is DISK
               for key in e.keys]
    assert sorted(removed) == sorted(bad)
    stored = [key for e in events if isinstance(e, BlockStored) for key in e.keys]
    assert stored == good
    [drop] = m.take_background_transfers()  # its record is deleted on every rank
    assert drop.dst.medium is Medium.DROP and drop.keys == tuple(bad)
    m.complete_background(drop.id, True)
    # both requests now miss (k(0) first): neither is pending, nothing is promoted again
    for _ in range(2):
        res = m.lookup([k(0), k(1)], sighting=False)
        assert res.tiers == () and not res.pending
    assert m.take_background_transfers() == []
    assert m.stats.failed_loads == len(bad)
    # the freed slots take new blocks (the promotion's own slots were given back)
    plan = m.prepare_store([k(50), k(51)])
    assert len(plan.keys) == 2 and (set(plan.cpu_slots) & slots)
    m.complete_store(plan.keys)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    assert m.pins() == 0 and m.stats.protocol_errors == 0


def test_a_promotion_bigger_than_the_cpu_tier_keeps_the_hits_own_ready_blocks():
    """The CPU tier holds 2 blocks; a hit of one READY block and 3 disk blocks promotes what
    fits without evicting the hit's READY block (evicting it would only move the miss)."""
    m = on_disk_only([k(1), k(2), k(3)], cpu_blocks=2)
    keys = [k(100), k(1), k(2), k(3)]  # k(100): a READY filler block, the hit's CPU run
    res = m.lookup(keys)
    assert res.pending and res.tiers == (CPU,)
    assert m.stats.load_truncated_no_space == 1  # 1 of 3 promotions had room
    [promotion] = m.take_background_transfers()
    assert promotion.keys == (k(1),)  # in key order
    assert m.cpu.is_ready(k(100)) and k(101) not in m.cpu  # the other block made the room
    m.complete_background(promotion.id, True)
    res = m.lookup(keys, sighting=False)  # no room for k(2): the run the tier holds, not pending
    assert res.tiers == (CPU, CPU) and not res.pending
    assert m.take_background_transfers() == []
    assert m.cpu.is_ready(k(100)) and m.cpu.is_ready(k(1))
    assert m.stats.load_truncated_no_space == 2
    plan = m.prepare_load(keys)
    assert plan.keys == (k(100), k(1)) and plan.sources == (CPU, DISK)
    m.complete_load(plan.keys)
    assert m.pins() == 0 and m.stats.protocol_errors == 0
    assert m.stats.hit_blocks["DISK"] == 1 and m.stats.hit_blocks["CPU"] == 1


def test_a_cpu_tier_full_of_pinned_blocks_promotes_nothing():
    m = on_disk_only([k(0)], cpu_blocks=2)
    loading = m.prepare_load([k(100), k(101)])  # another request's load pins the whole tier
    assert loading.keys == (k(100), k(101))
    res = m.lookup([k(100), k(101), k(0)])
    assert res.tiers == (CPU, CPU) and not res.pending  # the CPU run, no "not yet"
    res = m.lookup([k(0)])
    assert res.tiers == () and not res.pending
    assert m.take_background_transfers() == []
    assert k(0) not in m.cpu and m.disk.get(k(0)).readers == 0  # nothing reserved or pinned
    assert m.stats.load_truncated_no_space == 2
    assert m.pins() == 2
    m.complete_load(loading.keys)
    assert m.pins() == 0
    assert lookup_promoted(m, [k(0)], sighting=False).tiers == (CPU,)  # room now
    assert m.pins() == 0 and m.stats.protocol_errors == 0


def test_cpu_hits_are_parallel_readers():
    m = TieredOffloadingManager(cpu_blocks=4)
    plan = m.prepare_store([k(0), k(1)])
    m.complete_store(plan.keys)
    assert m.lookup([k(0), k(1)]).tiers == (CPU, CPU)
    loads = [m.prepare_load([k(0), k(1)]) for _ in range(3)]
    assert all(ld.keys == (k(0), k(1)) and ld.sources == () for ld in loads)
    assert len({ld.cpu_slots for ld in loads}) == 1
    assert m.take_background_transfers() == []
    assert m.pins() == 6
    for ld in loads:
        m.complete_load(ld.keys)
    assert m.pins() == 0


BLOCK_BYTES = 2 << 20


def test_a_promotions_wait_from_lookup_to_settling_is_recorded_for_the_cost_model():
    now = [100.0]
    m = on_disk_only([k(0), k(1), k(2)], cpu_blocks=4, block_bytes=BLOCK_BYTES)
    m._clock = lambda: now[0]
    recorded = []
    m.record_promotion = lambda medium, nbytes, seconds: recorded.append(
        (medium, nbytes, seconds))
    assert m.lookup([k(0), k(1)]).pending  # starts at t=100
    now[0] = 100.25
    assert m.lookup([k(0), k(1)]).pending  # a second request waits: no second timer
    now[0] = 100.5
    settle_promotions(m)
    assert recorded == [(DISK, 2 * BLOCK_BYTES, pytest.approx(0.5))]
    # a failed promotion teaches nothing (nothing was published)
    assert m.lookup([k(2)]).pending
    now[0] = 103.0
    settle_promotions(m, failed=[k(2)])
    assert len(recorded) == 1
    for t in m.take_background_transfers():  # the forgotten record's deletion
        assert t.dst.medium is Medium.DROP
        m.complete_background(t.id, True)
    assert m.pins() == 0 and m.stats.protocol_errors == 0


def test_the_recorded_wait_feeds_the_managers_cost_model():
    now = [0.0]
    cost = LoadCostModel(block_bytes=BLOCK_BYTES, block_tokens=16,
                         recompute_s_per_token=0.265 / 8192, probe_every=0)
    m = on_disk_only([k(0), k(1)], cpu_blocks=4, block_bytes=BLOCK_BYTES, cost=cost)
    m._clock = lambda: now[0]
    assert m.cost.bandwidth[DISK].fixed_samples == 0
    assert m.lookup([k(0), k(1)]).pending
    now[0] = 0.75
    settle_promotions(m)
    assert m.cost.bandwidth[DISK].fixed_samples == 1
    assert m.cost.bandwidth[DISK].fixed_s > 0
    plan = m.prepare_load([k(0), k(1)])
    assert plan.sources == (DISK, DISK)
    m.complete_load(plan.keys)
    assert m.pins() == 0 and m.stats.protocol_errors == 0
