"""Connects a manager to a publisher, on the manager's own thread.

``pump()`` drains ``take_events()`` into the publisher. Whatever the manager holds when the
feed starts (disk blocks restored from a previous run emit no events) is announced by an
initial resync, and a live walk of the manager's resident blocks is the publisher's resync
source: a resync goes out a chunk per ``pump`` (``kvtier.observe.events.resync``), so neither
start-up with a large restored disk tier nor a resync later stalls the scheduler thread. If the
manager's event bus itself dropped events (nobody drained it for too long), the publisher is
told the stream is lost and resyncs.

The vLLM connector, which also needs ``take_events()`` for vLLM's own publisher, calls
``publisher.publish(events)`` with the events it drained instead of ``pump()``.
"""

from __future__ import annotations

from kvtier.observe.events.publisher import EventPublisher
from kvtier.observe.events.resync import walk_resident
from kvtier.manager.abstract import OffloadingManager
from kvtier.manager.specs import BlockKey, Medium
from kvtier.manager.index.tier_index import BlockState


def resident_blocks(manager: OffloadingManager) -> dict[Medium, list[BlockKey]]:
    """READY blocks per tier of a manager (``OffloadingManager.tier``): the state the
    manager's events describe (blocks still being written have not been announced)."""
    out: dict[Medium, list[BlockKey]] = {}
    for medium in (Medium.CPU, Medium.DISK):
        tier = manager.tier(medium)
        if tier is None:
            continue
        out[tier.medium] = [k for k, e in tier.entries.items() if e.state is BlockState.READY]
    return out


class ManagerFeed:
    def __init__(self, manager: OffloadingManager, publisher: EventPublisher) -> None:
        self.manager = manager
        self.publisher = publisher
        publisher.set_resident_walk(lambda: walk_resident(manager))
        self._bus_dropped = self._dropped()
        manager.take_events()  # already reflected in the initial resync
        publisher.resync()

    def _dropped(self) -> int:
        return int(self.manager.events_dropped())

    def pump(self, events=None) -> None:
        """Publish the manager's new events. A caller that drains ``take_events`` itself (the
        vLLM connector hands them to vLLM too) passes what it drained."""
        if events is None:
            events = self.manager.take_events()
        dropped = self._dropped()
        if dropped != self._bus_dropped:
            self._bus_dropped = dropped
            self.publisher.mark_lost()
        self.publisher.publish(events)
