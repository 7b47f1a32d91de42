"""TieredOffloadingManager.prepare_shared_load: concurrent loads share one disk promotion.

vLLM #44294: when many requests hit one prefix at once, a second request whose blocks are
being promoted from disk for the first must neither read the disk again nor be cut short. It
joins the promotion (same CPU slot, pinned) and is settled after it.
"""

from __future__ import annotations

from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager
from support.plan_hops import disk_hop


def k(i: int) -> bytes:
    return f"key-{i}".encode()


def on_disk_only(keys, cpu_blocks=2):
    """A manager where ``keys`` live on disk only (demoted, then evicted from CPU)."""
    m = TieredOffloadingManager(cpu_blocks=cpu_blocks, disk_blocks=16, flush_reserve=cpu_blocks)
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
    assert m.lookup(keys).tiers == (Medium.DISK,) * len(keys)
    return m


def test_plain_prepare_load_stops_at_an_inflight_promotion():
    m = on_disk_only([k(0), k(1)])
    first = m.prepare_load([k(0), k(1)])
    assert first.from_disk == (True, True) and first.joined == ()
    second = m.prepare_load([k(0), k(1)])
    assert second.keys == ()  # the old behaviour: cut short (the caller recomputes)
    m.complete_load(first.keys)
    assert m.pins() == 0


def test_second_load_joins_the_promotion_and_sees_the_block_published():
    m = on_disk_only([k(0), k(1)])
    first = m.prepare_shared_load([k(0), k(1)])
    assert first.from_disk == (True, True) and first.joined == (False, False)
    second = m.prepare_shared_load([k(0), k(1)])
    assert second.keys == (k(0), k(1))
    assert second.joined == (True, True) and second.from_disk == (False, False)
    assert second.cpu_slots == first.cpu_slots  # reads the slot the promotion fills
    assert disk_hop(second) is None  # no second disk read
    m.complete_load(first.keys)
    assert m.lookup([k(0), k(1)]).tiers == (Medium.CPU, Medium.CPU)
    assert m.pins() == 2  # the joined load still pins both slots
    m.complete_load(second.keys)
    assert m.pins() == 0 and m.stats.protocol_errors == 0
    assert m.stats.hit_blocks["DISK"] == 4


def test_failed_promotion_fails_joined_loads_and_frees_the_slot_after_the_last():
    m = on_disk_only([k(0)], cpu_blocks=2)
    first = m.prepare_shared_load([k(0)])
    second = m.prepare_shared_load([k(0)])
    third = m.prepare_shared_load([k(0)])
    assert second.joined == (True,) and third.joined == (True,)
    slot = first.cpu_slots[0]
    m.complete_load(first.keys, failed=[k(0)])  # corrupt on disk
    assert k(0) not in m.disk and m.lookup([k(0)]).num_hits == 0
    assert m.prepare_shared_load([k(0)]).keys == ()  # nothing to join any more
    # the slot must stay reserved while joined loads may still read it
    plan = m.prepare_store([k(50), k(51)])
    assert slot not in plan.cpu_slots
    m.complete_store(plan.keys)
    m.complete_load(second.keys, failed=[k(0)])
    assert k(0) in m.cpu.entries  # still pinned by the third load
    m.complete_load(third.keys, failed=[k(0)])
    assert k(0) not in m.cpu.entries
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    assert m.pins() == 0 and m.stats.protocol_errors == 0


def test_cpu_hits_are_parallel_readers_and_unaffected_by_sharing():
    m = TieredOffloadingManager(cpu_blocks=4)
    plan = m.prepare_store([k(0), k(1)])
    m.complete_store(plan.keys)
    loads = [m.prepare_shared_load([k(0), k(1)]) for _ in range(3)]
    assert all(ld.keys == (k(0), k(1)) and ld.joined == (False, False) for ld in loads)
    assert m.pins() == 6
    for ld in loads:
        m.complete_load(ld.keys)
    assert m.pins() == 0
