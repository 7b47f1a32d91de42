"""CPU eviction while demotions are in flight walks O(batch + pins), not the whole tier (14.9).

With write-back, the cold end of the CPU order holds blocks being demoted (pinned) and dirty
blocks behind them. The old eviction skipped dirty blocks the disk would admit, so with a slow
disk every ``prepare_store`` walked every resident block (200-250 ms at 50k blocks) and then
refused the store anyway. The work is counted here as eviction-order keys examined per call,
with demotions that never complete (the slowest disk there is). Blocks whose eviction loses
nothing (a copy on disk) still go before dirty ones.
"""

from __future__ import annotations

import pytest

from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager
from support.promotions import is_promotion


def k(i: int) -> bytes:
    return i.to_bytes(8, "little")


class CountingWalk:
    """Counts keys the eviction policy examines: calls of its ``evictable`` predicate, and
    steps of its ``order_at`` walk (the handle-checked walk LRU offers)."""

    def __init__(self, policy) -> None:
        self.calls = 0
        inner, inner_order = policy.victims, getattr(policy, "order_at", lambda: None)

        def victims(n, evictable):
            def counted(key):
                self.calls += 1
                return evictable(key)
            return inner(n, counted)

        def order_at():
            order = inner_order()
            if order is None:
                return None

            def counted():
                for item in order:
                    self.calls += 1
                    yield item
            return counted()

        policy.victims = victims
        policy.order_at = order_at


def fill(m, nxt: int, batch: int, queued: list) -> int:
    """Store batches until the CPU tier is full; demotions are queued, not completed."""
    while len(m.cpu) < m.cpu.capacity:
        plan = m.prepare_store([k(nxt + i) for i in range(batch)])
        m.complete_store(plan.keys)
        queued += m.take_background_transfers()
        nxt += batch
    return nxt


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_store_with_a_stalled_disk_walks_a_bounded_number_of_blocks(policy):
    cpu, batch = 16_000, 32
    m = TieredOffloadingManager(cpu_blocks=cpu, cpu_eviction=policy, disk_blocks=4 * cpu,
                                flush_reserve=64)
    queued = []  # demotions handed out and never completed: a stalled disk
    nxt = fill(m, 0, batch, queued)
    walk = CountingWalk(m.cpu.policy)
    per_call = []
    for _ in range(100):
        walk.calls = 0
        plan = m.prepare_store([k(nxt + i) for i in range(batch)])
        per_call.append(walk.calls)
        m.complete_store(plan.keys)
        queued += m.take_background_transfers()
        nxt += batch
    # the eviction walk looks at most eviction_budget unpinned blocks past its batch, the
    # flush walk at most flush_reserve, and each steps over the pinned demotions once:
    # nothing proportional to the 16k resident blocks (the old walk looked at all of them)
    assert max(per_call) < cpu // 8, max(per_call)
    bound = (batch + m.eviction_budget + m.flush_reserve + 2 * m.max_demotions_in_flight)
    assert max(per_call) <= bound, (max(per_call), bound)
    demoting = sum(len(t.keys) for t in queued if t.dst.medium is Medium.DISK)
    assert demoting <= m.max_demotions_in_flight  # the disk's queue is bounded
    # no store was refused while unpinned blocks could go (the old rule refused them all)
    assert m.stats.store_skipped_no_space == 0 and m.stats.evicted_unwritten > 0
    for t in queued:  # the disk catches up: every pin is released
        m.complete_background(t.id, True)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    assert m.pins() == 0 and m.stats.protocol_errors == 0


def test_demoting_blocks_are_never_evicted_and_clean_ones_go_first():
    m = TieredOffloadingManager(cpu_blocks=8, disk_blocks=32, flush_reserve=4,
                                max_demotions_in_flight=4)
    plan = m.prepare_store([k(i) for i in range(8)])
    m.complete_store(plan.keys)
    [demotion] = m.take_background_transfers()  # the 4 coldest, pinned while copied
    assert set(demotion.keys) == {k(0), k(1), k(2), k(3)}
    plan = m.prepare_store([k(100), k(101)])  # write-back is behind: dirty 4 and 5 go
    assert plan.evicted[Medium.CPU] == (k(4), k(5))
    assert all(key in m.cpu for key in demotion.keys)
    assert m.take_background_transfers() == []  # the queue is full: nothing more is demoted
    m.complete_background(demotion.id, True)
    plan = m.prepare_store([k(102)])  # now clean: the coldest goes, its copy is on disk
    assert plan.evicted[Medium.CPU] == (k(0),)
    assert k(0) not in m.cpu and m.disk.is_ready(k(0))  # still a hit: on disk
    res = m.lookup([k(0)])  # promoted back from its disk copy
    assert res.pending and res.tiers == ()
    assert any(is_promotion(t) and t.keys == (k(0),) for t in m.take_background_transfers())
    assert m.stats.evicted_unwritten == 2


def test_a_clean_block_goes_before_a_colder_dirty_one():
    """Evicting a block with a copy on disk loses nothing (a later hit reads the disk), so it
    goes first while one lies within the eviction budget, even if warmer than dirty ones."""
    m = TieredOffloadingManager(cpu_blocks=8, disk_blocks=32, flush_reserve=2,
                                max_demotions_in_flight=2)
    plan = m.prepare_store([k(i) for i in range(8)])
    m.complete_store(plan.keys)
    [demotion] = m.take_background_transfers()
    assert set(demotion.keys) == {k(0), k(1)}
    m.complete_background(demotion.id, True)
    m.touch([k(1), k(0)])  # clean blocks are now the warmest: order 2..7, 1, 0
    plan = m.prepare_store([k(100)])
    assert plan.evicted[Medium.CPU] == (k(1),)
    assert k(1) not in m.cpu and m.disk.is_ready(k(1)) and m.stats.evicted_unwritten == 0
    res = m.lookup([k(1)])  # a hit still: promoted back from its disk copy
    assert res.pending and res.tiers == ()
    assert any(is_promotion(t) and t.keys == (k(1),) for t in m.take_background_transfers())


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_after_a_vain_search_the_next_one_looks_only_as_deep_as_what_turned_clean(policy):
    """Once an eviction had to drop dirty blocks, blocks deeper than the flush window are
    dirty: the next search covers only the blocks demotions made clean since, not the whole
    budget again (a 512-block store walked ~3k blocks per request in vain, 10 ms)."""
    cpu, batch = 4_000, 128
    m = TieredOffloadingManager(cpu_blocks=cpu, cpu_eviction=policy, disk_blocks=4 * cpu,
                                flush_reserve=64, max_demotions_in_flight=96)
    queued: list = []
    nxt = fill(m, 0, batch, queued)
    walk = CountingWalk(m.cpu.policy)
    plan = m.prepare_store([k(nxt + i) for i in range(batch)])  # dirty blocks must go
    nxt += batch
    m.complete_store(plan.keys)
    assert m.stats.evicted_unwritten > 0 and m.eviction.write_back_behind
    done = queued.pop(0)  # the disk finishes one demotion: its blocks are clean now
    m.complete_background(done.id, True)
    queued += m.take_background_transfers()
    walk.calls = 0
    before = m.stats.evicted_unwritten
    plan = m.prepare_store([k(nxt + i) for i in range(batch)])
    # the eviction: the batch, the newly clean blocks, the pinned demotions stepped over;
    # the flush walk: its window (the batch) and the pins (the old search: + 384 more)
    assert len(done.keys) < batch
    pinned = m.max_demotions_in_flight
    bound = batch + len(done.keys) + pinned + max(batch, m.flush_reserve) + pinned
    assert walk.calls <= bound, (walk.calls, bound)
    # and the clean blocks were still found and went first
    assert set(done.keys) <= set(plan.evicted[Medium.CPU])
    assert m.stats.evicted_unwritten - before == batch - len(done.keys)


def test_a_store_bigger_than_the_flush_reserve_is_written_back_whole():
    """Write-back looks as deep as the store just planned: with a fixed window of
    ``flush_reserve`` (here 64), stores of 256 blocks had 3 blocks of 4 evicted unwritten
    even though the disk finished every demotion before the next store."""
    cpu, batch = 2_048, 256
    m = TieredOffloadingManager(cpu_blocks=cpu, disk_blocks=8 * cpu, flush_reserve=64,
                                max_demotions_in_flight=4 * batch)
    nxt = 0
    for _ in range(40):
        plan = m.prepare_store([k(nxt + i) for i in range(batch)])
        m.complete_store(plan.keys)
        nxt += batch
        for t in m.take_background_transfers():  # a disk that keeps up
            m.complete_background(t.id, True)
    assert m.stats.evicted_blocks["CPU"] >= 20 * batch
    assert m.stats.evicted_unwritten == 0
    assert m.stats.stored_blocks["DISK"] >= m.stats.evicted_blocks["CPU"]


def test_a_disk_hit_makes_room_in_one_eviction():
    """A lookup promoting many blocks from disk evicts for all of them at once: one walk and
    one CPU removal event, not one per block."""
    cpu = 64
    m = TieredOffloadingManager(cpu_blocks=cpu, disk_blocks=8 * cpu, flush_reserve=cpu)
    old = [k(i) for i in range(cpu)]
    for keys in (old, [k(1000 + i) for i in range(cpu)]):  # the second evicts the first
        plan = m.prepare_store(keys)
        m.complete_store(plan.keys)
        for t in m.take_background_transfers():
            m.complete_background(t.id, True)
    assert all(m.disk.is_ready(key) and key not in m.cpu for key in old)
    m.take_events()
    res = m.lookup(old[:48])
    assert res.pending and res.tiers == ()
    [promotion] = m.take_background_transfers()
    assert is_promotion(promotion) and promotion.keys == tuple(old[:48])
    assert len(set(promotion.dst.ids)) == 48
    removed = [e for e in m.take_events()
               if type(e).__name__ == "BlockRemoved" and e.medium is Medium.CPU]
    assert len(removed) == 1 and len(removed[0].keys) == 48
    m.complete_background(promotion.id, True)
    assert m.lookup(old[:48], sighting=False).tiers == (Medium.CPU,) * 48
    plan = m.prepare_load(old[:48])
    assert plan.keys == tuple(old[:48]) and plan.cpu_slots == promotion.dst.ids
    assert plan.sources == (Medium.DISK,) * 48
    m.complete_load(plan.keys)
    for t in m.take_background_transfers():
        m.complete_background(t.id, True)
    assert m.pins() == 0 and m.stats.protocol_errors == 0


class HeldRemotely:
    """A shared-tier presence directory whose server holds the keys from ``first`` on."""

    degraded, degradations = False, 0

    def __init__(self, first: int) -> None:
        self.first = first

    def query(self, keys):
        return [self.known_present(key) for key in keys]

    def known_present(self, key):
        return int.from_bytes(key, "little") >= self.first

    known_held = known_present  # its values are valid records

    def learned(self, keys, present):
        pass

    def recheck(self, keys):  # its answers never change
        return 0


def test_a_remote_hit_makes_room_for_its_promotions_in_one_walk():
    """A 2,048-block REMOTE hit into a full CPU tier whose cold end is pinned by writes to the
    shared tier: the eviction walks past those pins once, not once per promoted block (a
    walk quadratic in the hit's length, inside the scheduler's step)."""
    cpu, hit = 4096, 2048
    m = TieredOffloadingManager(cpu_blocks=cpu, remote=HeldRemotely(100_000),
                                remote_max_writes=256)
    for start in range(0, cpu, 512):  # full; the first 256 are pinned by their writes
        plan = m.prepare_store([k(i) for i in range(start, start + 512)])
        m.complete_store(plan.keys)
    writes = m.take_background_transfers()
    assert sum(len(t.keys) for t in writes) == 256
    m.take_events()
    walk = CountingWalk(m.cpu.policy)
    keys = [k(100_000 + i) for i in range(hit)]
    res = m.lookup(keys)  # the lookup promotes the whole hit: "not yet"
    assert res.pending and res.tiers == ()
    [promotion] = m.take_background_transfers()
    assert is_promotion(promotion) and promotion.src.medium is Medium.REMOTE
    assert promotion.keys == tuple(keys) and len(set(promotion.dst.ids)) == hit
    assert walk.calls <= hit + 256 + 1, walk.calls  # one walk: the victims and the pins once
    removed = [e for e in m.take_events() if type(e).__name__ == "BlockRemoved"]
    assert len(removed) == 1 and len(removed[0].keys) == hit  # one eviction, one event
    pinned = {key for t in writes for key in t.keys}
    assert not pinned & set(removed[0].keys)  # blocks being written were never evicted
    m.complete_background(promotion.id, True)
    assert m.lookup(keys, sighting=False).tiers == (Medium.CPU,) * hit
    plan = m.prepare_load(keys)
    assert plan.sources == (Medium.REMOTE,) * hit and plan.cpu_slots == promotion.dst.ids
    m.complete_load(plan.keys)
    while writes:  # the server takes every write: the backlog drains, every pin is released
        for t in writes:
            m.complete_background(t.id, True)
        writes = m.take_background_transfers()
    assert m.pins() == 0
