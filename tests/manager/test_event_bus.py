"""Manager events: drained by take_events, in order, bounded."""

from kvtier.manager.events import BlockAccessed, BlockRemoved, BlockStored, EventBus
from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager


def k(i):
    return f"k{i}".encode()


def test_manager_events_are_drained_in_order():
    m = TieredOffloadingManager(cpu_blocks=2)
    plan = m.prepare_store([k(0), k(1)])
    m.complete_store(plan.keys)
    m.prepare_load([k(0)])
    plan = m.prepare_store([k(2)])  # evicts k(1) (k(0) is pinned)
    m.complete_store(plan.keys)
    kinds = [(type(e), e.medium, e.keys) for e in m.take_events()]
    assert kinds == [
        (BlockStored, Medium.CPU, (k(0), k(1))),
        (BlockAccessed, Medium.CPU, (k(0),)),
        (BlockRemoved, Medium.CPU, (k(1),)),
        (BlockStored, Medium.CPU, (k(2),)),
    ]
    assert m.take_events() == []


def test_pending_events_are_bounded():
    bus = EventBus(max_pending=5)
    for i in range(8):
        bus.emit(BlockStored(Medium.CPU, (k(i),)))
    evs = bus.take_events()
    assert len(evs) == 5 and evs[0].keys == (k(3),) and bus.dropped == 3
    bus.emit(BlockStored(Medium.CPU, ()))  # empty events are not recorded
    assert bus.take_events() == []
