"""``EventSubscriber``: reads a kvtier (or vLLM) event stream in order, filling holes by replay.

ZMQ PUB/SUB loses messages silently (a subscriber that is slow, or still joining, misses
them), so the subscriber tracks sequence numbers. Batches arriving ahead of a hole are held;
the hole is requested from the publisher's replay socket; batches are delivered strictly in
order, each exactly once. When the history is gone (replay reports a gap, or there is no
replay socket) a ``Gap`` is delivered before the stream continues: the consumer's view may then
be incomplete until the next ``AllBlocksCleared`` (kvtier's publisher resyncs after a gap).

Frames are only decoded by msgspec into the declared types; a frame that does not decode is
counted and reported as a gap of one batch, never guessed at.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.observe.events.wire import (
    END_SEQ,
    GAP_SEQ,
    SEQ_BYTES,
    DecodeError,
    KvtierEventBatch,
    decode_batch,
    decode_gap,
    seq_of,
)

SUB_HWM = 100_000
REPLAY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Delivery:
    seq: int
    batch: KvtierEventBatch
    replayed: bool  # came through the replay socket, not the live stream


@dataclass(frozen=True)
class Gap:
    expected: int  # first sequence number that will never be delivered
    resumed_at: int  # first one delivered after the gap (-1: not known yet)
    reason: str


Item = Delivery | Gap


class EventSubscriber:
    """``start_seq``: the first sequence number wanted (0 = the whole buffered history; the
    last seen + 1 after a reconnect; None = whatever the live stream brings next).
    ``watch_connection``: keep track of whether a publisher answered (``connected``)."""

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 start_seq: int | None = 0, context: zmq.Context | None = None,
                 watch_connection: bool = False) -> None:
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._topic = topic.encode()
        self._sub = self._ctx.socket(zmq.SUB)
        self._replay: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._connected = False
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, SUB_HWM)
            self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            if watch_connection:  # before connecting: its event must not be missed
                self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED)
            self._sub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.DEALER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.RCVHWM, 0)
                self._replay.connect(replay_endpoint)
        except zmq.ZMQError:
            self.close()  # a bad endpoint must not leave a context that blocks at exit
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        if self._replay is not None:
            self._poller.register(self._replay, zmq.POLLIN)
        self.expected: int | None = start_seq
        self._pending: dict[int, KvtierEventBatch | None] = {}  # None: arrived undecodable
        self._pending_replayed: set[int] = set()
        self._replay_deadline: float | None = None  # set while a request is in flight
        self._replay_from = -1
        self._out: list[Item] = []
        self.bad_frames = 0
        self.foreign_frames = 0
        self.replay_requests = 0
        if start_seq is not None and self._replay is not None:
            self._request_replay(start_seq)

    # ------------------------------------------------------------------ public
    def poll(self, timeout_s: float = 1.0) -> list[Item]:
        """What arrived within ``timeout_s`` (returns as soon as anything is deliverable)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain()
            if self._out:
                out, self._out = self._out, []
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            self._poller.poll(max(1, int(min(left, 0.1) * 1000)))

    def sync(self, timeout_s: float = REPLAY_TIMEOUT_S) -> list[Item]:
        """Ask replay for everything after what was delivered and wait for its answer: after
        this, nothing published before the call is missing (unless a ``Gap`` says so)."""
        if self._replay is None:
            raise RuntimeError("sync() needs a replay endpoint")
        deadline = time.monotonic() + timeout_s
        while self._replay_deadline is not None and time.monotonic() < deadline:
            self._step(deadline)  # let an earlier request finish first
        self._request_replay(self.expected if self.expected is not None else 0)
        while self._replay_deadline is not None:
            if time.monotonic() >= deadline:
                raise TimeoutError("no replay answer from the publisher")
            self._step(deadline)
        self._drain()
        out, self._out = self._out, []
        return out

    def connected(self) -> bool:
        """Whether a publisher has answered at the endpoint (``watch_connection`` only). A ZMQ
        connect to an address where nothing listens succeeds and retries in silence, so
        without this nothing tells an absent instance from a quiet one."""
        while (not self._connected and self._monitor is not None
               and self._monitor.poll(0, zmq.POLLIN)):
            self._connected = recv_monitor_message(self._monitor)["event"] == zmq.EVENT_CONNECTED
        return self._connected

    def close(self) -> None:
        if self._monitor is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> "EventSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ receiving
    def _step(self, deadline: float) -> None:
        self._poller.poll(max(1, int(min(deadline - time.monotonic(), 0.1) * 1000)))
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                frames = self._sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_frames(frames, replayed=False)
        while self._replay is not None:
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames and frames[0] == b"":
                frames = frames[1:]
            self._on_frames(frames, replayed=True)
        if self._replay_deadline is not None and time.monotonic() > self._replay_deadline:
            self._replay_deadline = None  # lost request: the next hole asks again
        self._advance()

    def _on_frames(self, frames: list[bytes], replayed: bool) -> None:
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self.bad_frames += 1
            return
        topic, raw_seq, payload = frames
        seq = seq_of(raw_seq)
        if replayed and seq == END_SEQ:
            self._on_replay_end()
            return
        if topic != self._topic:
            self.foreign_frames += 1
            return
        if replayed and seq == GAP_SEQ:
            try:
                gap = decode_gap(payload)
            except DecodeError:
                self.bad_frames += 1
                return
            self._on_gap(gap.first_available, "replay buffer no longer holds it")
            return
        if seq < 0:
            self.bad_frames += 1
            return
        if self.expected is None:
            self.expected = seq
        if seq < self.expected or seq in self._pending:
            return  # already delivered (replay and live overlap)
        try:
            self._pending[seq] = decode_batch(payload)
        except DecodeError:
            self.bad_frames += 1
            self._pending[seq] = None
        if replayed:
            self._pending_replayed.add(seq)

    def _on_gap(self, first_available: int, reason: str) -> None:
        if self.expected is None:
            return
        resume = first_available if first_available >= 0 else min(self._pending, default=-1)
        if resume > self.expected or (resume < 0 and first_available < 0):
            self._out.append(Gap(self.expected, resume, reason))
            if resume > self.expected:
                self.expected = resume

    def _on_replay_end(self) -> None:
        self._replay_deadline = None
        self._advance()
        if self._pending and self.expected not in self._pending:
            if self.expected > self._replay_from:
                self._request_replay(self.expected)  # progress made: ask for the rest
            else:
                self._on_gap(min(self._pending), "replay did not return it")

    def _advance(self) -> None:
        if self.expected is None:
            return
        while self.expected in self._pending:
            seq = self.expected
            batch = self._pending.pop(seq)
            replayed = seq in self._pending_replayed
            self._pending_replayed.discard(seq)
            if batch is None:
                self._out.append(Gap(seq, seq + 1, "undecodable batch"))
            else:
                self._out.append(Delivery(seq, batch, replayed))
            self.expected = seq + 1
        if self._pending:  # a hole before what we hold
            if self._replay is None:
                self._on_gap(min(self._pending), "no replay endpoint")
                self._advance()
            elif self._replay_deadline is None:
                self._request_replay(self.expected)

    def _request_replay(self, start: int) -> None:
        assert self._replay is not None
        self._replay.send_multipart((b"", max(0, start).to_bytes(SEQ_BYTES, "big")))
        self._replay_from = start
        self._replay_deadline = time.monotonic() + REPLAY_TIMEOUT_S
        self.replay_requests += 1
