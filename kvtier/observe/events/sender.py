"""The publisher's own thread: encodes, numbers, sends and buffers batches, answers replay.

A mixin of ``EventPublisher`` (split out to keep each file short; it shares the publisher's
state and is not used on its own). Only this thread touches the sockets; the caller side only
appends to the queue under the lock.
"""

from __future__ import annotations

import logging
import os

import zmq

from kvtier.observe.events.wire import (
    END_SEQ,
    GAP_SEQ,
    SEQ_BYTES,
    AllBlocksCleared,
    KvtierEventBatch,
    encode_batch,
    encode_gap,
    seq_bytes,
)

log = logging.getLogger("kvtier.observe.events.publisher")  # the name operators already filter on

MAX_BATCH_EVENTS = 1024  # wire events per batch when several publish() calls are coalesced
MAX_REPLAY_REQUESTS_PER_WAKE = 16


class PublisherThread:
    """The sending side of ``EventPublisher``; see the module docstring."""
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(0 if self._queue else 1000))
                if self._wake_r in ready:
                    self._signalled = False
                    os.read(self._wake_r, 4096)
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                with self._lock:
                    items = list(self._queue)
                    self._queue.clear()
                    self._queued_events = 0
                    self._resync_queued = False
                    self._chunk_queued = False
                if items:
                    self._send_items(items)
                    with self._lock:
                        self._sent += len(items)
                        self._done.notify_all()
                elif self._closing:
                    break
        except Exception:  # noqa: BLE001 - never take the instance down; log once, stop
            log.exception("kvtier events: publisher thread failed; events are off")
        finally:
            self._close_sockets()
            with self._lock:
                self._done.notify_all()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=500)

    def _send_items(self, items: list) -> None:  # of publisher._Item
        state: list = []
        access: list = []
        ts: float | None = None
        for item in items:
            ts = item.ts if ts is None else ts
            if item.cleared:
                state.append(AllBlocksCleared())
            for medium, keys in (item.resident or {}).items():
                state.extend(self._converter.stored(medium, keys))
            s, a = self._converter.convert(item.events)
            state.extend(s)
            access.extend(a)
            if len(state) + len(access) >= MAX_BATCH_EVENTS:
                self._send(KvtierEventBatch(ts, state, self._dp_rank, access))
                state, access, ts = [], [], None
        if ts is not None and (state or access):
            self._send(KvtierEventBatch(ts, state, self._dp_rank, access))

    def _send(self, batch: KvtierEventBatch) -> None:
        try:
            payload = encode_batch(batch)
        except Exception:  # noqa: BLE001 - e.g. a wire_hash returning an unencodable value
            log.exception("kvtier events: cannot encode a batch; consumers will be resynced")
            with self._lock:
                self._stats.send_errors += 1
            self._lost = True
            return
        seq = self._seq
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB drops at HWM itself; kept for sockets that do not
            with self._lock:
                self._stats.send_errors += 1
        self._seq += 1
        self._buffer.append(seq, payload)
        with self._lock:
            self._stats.batches += 1
            self._stats.events += len(batch.events)
            self._stats.access_events += len(batch.access)
            self._stats.last_seq = seq

    def _serve_replay(self) -> None:
        assert self._replay is not None
        for _ in range(MAX_REPLAY_REQUESTS_PER_WAKE):
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            bad = len(frames) != 3 or len(frames[2]) != SEQ_BYTES
            with self._lock:
                self._stats.replay_requests += 1
                self._stats.bad_requests += bad
            if bad:
                if len(frames) >= 2:  # tell the client it is done rather than let it hang
                    self._reply(frames[0], b"", END_SEQ, b"")
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            gap, batches = self._buffer.reply(start)
            if gap is not None:
                with self._lock:
                    self._stats.replay_gaps += 1
                self._gap_seen = True
                self._reply(client, self._topic, GAP_SEQ, encode_gap(gap))
            for seq, payload in batches:
                self._reply(client, self._topic, seq, payload)
            self._reply(client, b"", END_SEQ, b"")

    def _reply(self, client: bytes, topic: bytes, seq: int, payload: bytes) -> None:
        try:
            self._replay.send_multipart((client, b"", topic, seq_bytes(seq), payload),
                                        flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            with self._lock:
                self._stats.send_errors += 1
