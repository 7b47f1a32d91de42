"""``ReplayStreams``: replay answers sent a few batches at a time, to a bounded set of clients.

Why: an answer queued whole into the ZMQ pipe of the client that asked (in vLLM's scheduler
process) would let a client that never reads pin up to the replay buffer's bytes, and every
further client as much again. So each answer is a stream with a cursor: each pass of the
publisher's thread sends up to ``CHUNK_BATCHES`` batches per stream, until the client's pipe
is full (``ROUTER_MANDATORY`` and a send limit of ``events.replay_client_max_bytes``: EAGAIN),
and continues when the client has read.

At most ``events.replay_max_clients`` streams run at once; a request beyond that is answered
with the end marker alone (the consumer sees no progress, reports a gap and asks again later).
A stream that makes no progress for ``events.stall_timeout_s`` is abandoned (its client's
connection is dropped by the peer watch too); both are counted. History evicted from the buffer
while a stream is behind it is announced with a ``ReplayGap``, never skipped silently."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable

from kvtier.observe.events.replay import ReplayBuffer
from kvtier.observe.events.wire import END_SEQ, GAP_SEQ, ReplayGap, encode_gap

CHUNK_BATCHES = 64  # per stream and pass: one slow stream cannot hold the thread


class Sent(Enum):
    OK = "ok"
    FULL = "full"  # the client's pipe is at its limit: try again on a later pass
    GONE = "gone"  # the client disconnected


# (client, topic?, seq, payload) -> Sent; topic is False for the end marker (empty topic)
Send = Callable[[bytes, bool, int, bytes], Sent]


@dataclass
class _Stream:
    next_seq: int
    progress_at: float


@dataclass
class ReplayCounts:
    refused: int = 0  # requests beyond replay_max_clients
    stalled: int = 0  # streams abandoned without progress
    gaps: int = 0  # gap notices sent


class ReplayStreams:
    def __init__(self, buffer: ReplayBuffer, *, max_clients: int, stall_s: float) -> None:
        self.buffer = buffer
        self.max_clients = max_clients
        self.stall_s = stall_s
        self.counts = ReplayCounts()
        self._streams: dict[bytes, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def start(self, client: bytes, start: int, now: float) -> bool:
        """Begin (or restart) ``client``'s answer from ``start``; False if too many run."""
        if client not in self._streams and len(self._streams) >= self.max_clients:
            self.counts.refused += 1
            return False
        self._streams[client] = _Stream(max(0, start), now)
        return True

    def pump(self, send: Send, now: float) -> None:
        for client, stream in list(self._streams.items()):
            if self._advance(client, stream, send, now):
                del self._streams[client]
            elif now - stream.progress_at >= self.stall_s:
                self.counts.stalled += 1
                del self._streams[client]

    def _advance(self, client: bytes, s: _Stream, send: Send, now: float) -> bool:
        """Send up to a chunk; True when the stream is over (finished or client gone)."""
        buf = self.buffer
        for _ in range(CHUNK_BATCHES):
            first, last = buf.first_seq, buf.last_seq
            if s.next_seq > last:
                result = send(client, False, END_SEQ, b"")
                return result is not Sent.FULL
            if first < 0 or s.next_seq < first:  # evicted before it was sent: say so
                result = send(client, True, GAP_SEQ, encode_gap(ReplayGap(s.next_seq, first)))
                if result is Sent.OK:
                    self.counts.gaps += 1
                    s.next_seq = first if first >= 0 else last + 1
            else:
                payload = buf.get(s.next_seq)
                result = Sent.OK if payload is None else send(client, True, s.next_seq,
                                                               payload)
                if result is Sent.OK:
                    s.next_seq += 1
            if result is Sent.GONE:
                return True
            if result is Sent.FULL:
                return False
            s.progress_at = now
        return False
