"""Manager events: what entered, left or was read from each tier.

``take_events()`` drains them (vLLM's connector passes them on to its event publisher). Nobody
draining for too long loses the oldest events, counted in ``dropped``, instead of growing the
manager's memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from kvtier.manager.specs import BlockKey, Medium


@dataclass(frozen=True)
class _TierEvent:
    medium: Medium
    keys: tuple[BlockKey, ...]
    ts: float = field(default_factory=time.time)


class BlockStored(_TierEvent):
    """``keys`` entered ``medium``."""


class BlockRemoved(_TierEvent):
    """``keys`` left ``medium``."""


class BlockAccessed(_TierEvent):
    """A hit: ``keys`` were found in ``medium`` and will be loaded from it."""


Event = BlockStored | BlockRemoved | BlockAccessed


class EventBus:
    """Collects events; ``take_events`` drains (bounded, oldest dropped and counted)."""

    def __init__(self, max_pending: int = 1_000_000) -> None:
        self._pending: deque[Event] = deque()
        self._max_pending = max_pending
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

    def take_events(self) -> list[Event]:
        with self._lock:
            out = list(self._pending)
            self._pending.clear()
        return out
