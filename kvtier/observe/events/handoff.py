"""``Handoff``: everything the publisher's caller and its sending thread share, in one place.

The caller (the thread that owns the manager) appends items and reads counters; the sending
thread takes the items and reports what it sent. Both hold ``lock`` for anything but a flag.
``lost`` and ``gap_seen`` are flags either side may raise (a dropped or unencodable event, a
replay client that missed history): the caller's next ``publish`` resyncs.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Mapping

from kvtier.manager.specs import BlockKey, Medium


@dataclass
class PublisherStats:
    batches: int = 0  # batches sent (sequence numbers used)
    events: int = 0  # state events sent (BlockStored / BlockRemoved / AllBlocksCleared)
    access_events: int = 0
    dropped_events: int = 0  # manager events dropped because the queue was full
    resyncs: int = 0
    replay_requests: int = 0
    replay_gaps: int = 0  # replay requests that reached back past the buffer
    bad_requests: int = 0
    send_errors: int = 0
    metadata_errors: int = 0
    last_seq: int = -1
    queued: int = 0
    subscribers: int = 0  # connected now (tcp / ipc)
    subscribers_dropped: int = 0  # stopped reading for stall_timeout_s: disconnected
    subscribers_refused: int = 0  # beyond max_subscribers: disconnected at once
    replay_clients: int = 0
    replay_clients_dropped: int = 0
    replay_clients_refused: int = 0
    replay_busy: int = 0  # requests beyond replay_max_clients answers under way
    replay_stalled: int = 0  # answers abandoned: the client stopped reading
    replay_buffer_bytes: int = 0  # held by the replay buffer (at most replay_max_bytes)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Item:
    ts: float
    events: list  # manager events
    cleared: bool = False  # emit AllBlocksCleared first
    resident: Mapping[Medium, list[BlockKey]] | None = None  # then these as BlockStored


class Handoff:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)  # notified as items are sent
        self.queue: deque[Item] = deque()
        self.queued_events = 0
        self.enqueued = 0  # items ever queued / sent: flush() waits for these to meet
        self.sent = 0
        self.resync_queued = False  # a resync item waits in the queue
        self.chunk_queued = False  # the last chunk of a walk still waits
        self.stats = PublisherStats()
        self.lost = False
        self.gap_seen = False
        self.signalled = False  # a wake-up byte is in the pipe
        self.closing = False

    def enqueue_locked(self, item: Item) -> None:
        self.queue.append(item)
        self.queued_events += len(item.events)
        self.enqueued += 1

    def take(self) -> list[Item]:
        """Everything queued, for the sending thread (the queue is then empty)."""
        with self.lock:
            items = list(self.queue)
            self.queue.clear()
            self.queued_events = 0
            self.resync_queued = False
            self.chunk_queued = False
        return items

    def finished(self, n: int) -> None:
        with self.lock:
            self.sent += n
            self.done.notify_all()

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, n in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)
