"""Manager events: what entered, left or was read from each tier.

``take_events()`` drains them for a synchronous caller (vLLM's connector passes them on to its
event publisher); in-process subscribers get their own bounded async stream. A slow subscriber
loses its oldest events and is told how many (``dropped``) instead of slowing the manager.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator

from kvtier.manager.specs import BlockKey, Medium


@dataclass(frozen=True)
class BlockStored:
    medium: Medium
    keys: tuple[BlockKey, ...]
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class BlockRemoved:
    medium: Medium
    keys: tuple[BlockKey, ...]
    ts: float = field(default_factory=time.time)


@dataclass(frozen=True)
class BlockAccessed:
    """A hit: ``keys`` were found in ``medium`` and will be loaded from it."""

    medium: Medium
    keys: tuple[BlockKey, ...]
    ts: float = field(default_factory=time.time)


Event = BlockStored | BlockRemoved | BlockAccessed


class Subscription:
    """An async iterator of events for one in-process subscriber (bounded)."""

    def __init__(self, bus: "EventBus", maxlen: int, loop: asyncio.AbstractEventLoop) -> None:
        self._bus = bus
        self._buf: deque[Event] = deque()
        self._maxlen = maxlen
        self._loop = loop
        self._wakeup = asyncio.Event()
        self.dropped = 0
        self.closed = False

    def _push(self, events: list[Event]) -> None:
        for ev in events:
            if len(self._buf) >= self._maxlen:
                self._buf.popleft()
                self.dropped += 1
            self._buf.append(ev)
        self._loop.call_soon_threadsafe(self._wakeup.set)

    def close(self) -> None:
        self.closed = True
        self._bus._unsubscribe(self)
        self._loop.call_soon_threadsafe(self._wakeup.set)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while not self._buf:
            if self.closed:
                raise StopAsyncIteration
            self._wakeup.clear()
            if self._buf:
                break
            await self._wakeup.wait()
        return self._buf.popleft()


class EventBus:
    """Collects events; ``take_events`` drains (bounded, oldest dropped and counted)."""

    def __init__(self, max_pending: int = 1_000_000) -> None:
        self._pending: deque[Event] = deque()
        self._max_pending = max_pending
        self._subs: list[Subscription] = []
        self._lock = threading.Lock()
        self.dropped = 0

    def emit(self, event: Event) -> None:
        if not event.keys:
            return
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self._pending.popleft()
                self.dropped += 1
            self._pending.append(event)
            subs = list(self._subs)
        for s in subs:
            s._push([event])

    def take_events(self) -> list[Event]:
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        return out

    def subscribe(self, maxlen: int = 100_000) -> Subscription:
        """Call from a running event loop; iterate the result with ``async for``."""
        sub = Subscription(self, maxlen, asyncio.get_running_loop())
        with self._lock:
            self._subs.append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
