"""Manager events: drained by take_events, streamed to async subscribers, bounded."""

import asyncio

from kvtier.manager.events import BlockAccessed, BlockRemoved, BlockStored, EventBus
from kvtier.manager.specs import Medium
from kvtier.manager.tiered import TieredOffloadingManager


def k(i):
    return f"k{i}".encode()


async def test_async_subscriber_sees_manager_events_in_order():
    m = TieredOffloadingManager(cpu_blocks=2)
    sub = m.events.subscribe()
    plan = m.prepare_store([k(0), k(1)])
    m.complete_store(plan.keys)
    m.prepare_load([k(0)])
    plan = m.prepare_store([k(2)])  # evicts k(1) (k(0) is pinned)
    m.complete_store(plan.keys)
    got = []
    async for ev in sub:
        got.append(ev)
        if len(got) == 4:
            sub.close()
    kinds = [(type(e), e.medium, e.keys) for e in got]
    assert kinds == [
        (BlockStored, Medium.CPU, (k(0), k(1))),
        (BlockAccessed, Medium.CPU, (k(0),)),
        (BlockRemoved, Medium.CPU, (k(1),)),
        (BlockStored, Medium.CPU, (k(2),)),
    ]
    assert [type(e) for e in m.take_events()] == [BlockStored, BlockAccessed, BlockRemoved, BlockStored]
    assert m.take_events() == []


async def test_slow_subscriber_is_bounded_and_counts_drops():
    bus = EventBus()
    sub = bus.subscribe(maxlen=3)
    for i in range(10):
        bus.emit(BlockStored(Medium.CPU, (k(i),)))
    assert sub.dropped == 7
    first = await asyncio.wait_for(sub.__anext__(), 1)
    assert first.keys == (k(7),)


async def test_subscriber_wakes_on_emit_from_another_thread():
    bus = EventBus()
    sub = bus.subscribe()
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, lambda: asyncio.get_running_loop().run_in_executor(
        None, bus.emit, BlockRemoved(Medium.DISK, (k(1),))))
    ev = await asyncio.wait_for(sub.__anext__(), 5)
    assert ev.medium is Medium.DISK and ev.keys == (k(1),)
    sub.close()
    assert [e async for e in sub] == []


def test_pending_events_are_bounded():
    bus = EventBus(max_pending=5)
    for i in range(8):
        bus.emit(BlockStored(Medium.CPU, (k(i),)))
    evs = bus.take_events()
    assert len(evs) == 5 and evs[0].keys == (k(3),) and bus.dropped == 3
    bus.emit(BlockStored(Medium.CPU, ()))  # empty events are not recorded
    assert bus.take_events() == []
