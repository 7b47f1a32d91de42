"""The replay buffer: the last published batches, for consumers that connected late.

A consumer asks for everything after the last sequence number it saw (vLLM's protocol: an
8-byte big-endian start sequence to a ROUTER socket). When the batches it needs are no longer
buffered it is told so with a ``ReplayGap`` before the rest, never silently handed a partial
history (replay_streams.py). Bounded by batch count and by bytes (``events.replay_max_bytes``), whichever binds
first; answers are streamed from here a few batches at a time (replay_streams.py).
"""

from __future__ import annotations

from collections import deque

from kvtier.config.schema import DEFAULT_EVENTS_REPLAY_MAX_BYTES


class ReplayBuffer:
    def __init__(self, max_batches: int,
                 max_bytes: int = DEFAULT_EVENTS_REPLAY_MAX_BYTES) -> None:
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("replay buffer bounds must be positive")
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self._items: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self.last_seq = -1  # highest sequence ever appended (-1: none yet)

    def append(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            raise ValueError(f"sequence numbers must increase: {seq} after {self.last_seq}")
        self._items.append((seq, payload))
        self._bytes += len(payload)
        self.last_seq = seq
        while len(self._items) > self.max_batches or (
                self._bytes > self.max_bytes and len(self._items) > 1):
            _, old = self._items.popleft()
            self._bytes -= len(old)

    @property
    def first_seq(self) -> int:
        return self._items[0][0] if self._items else -1

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, seq: int) -> bytes | None:
        """The batch numbered ``seq`` if still buffered."""
        first = self.first_seq
        if first < 0 or not first <= seq <= self.last_seq:
            return None
        i = seq - first  # the publisher numbers its batches without holes
        if i < len(self._items) and self._items[i][0] == seq:
            return self._items[i][1]
        return next((p for s, p in self._items if s == seq), None)
