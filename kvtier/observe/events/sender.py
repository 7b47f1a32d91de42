"""``EventSender``: the publisher's own thread. Encodes, numbers, sends and buffers batches,
answers replay, and watches the clients.

Only this thread touches the sockets; it shares with the caller's side only the ``Handoff``
(queued items, counters, the lost/gap flags). ``EventPublisher`` builds it with the sockets it
bound and runs ``run`` on a thread of its own.
"""

from __future__ import annotations

import errno
import logging
import os
import time

import zmq

from kvtier.observe.events.convert import EventConverter
from kvtier.observe.events.handoff import Handoff, Item
from kvtier.observe.events.peers import CHECK_INTERVAL_S, PeerWatch
from kvtier.observe.events.replay import ReplayBuffer
from kvtier.observe.events.replay_streams import ReplayStreams, Sent
from kvtier.observe.events.split import split_batch
from kvtier.observe.events.wire import (
    END_SEQ,
    SEQ_BYTES,
    AllBlocksCleared,
    KvtierEventBatch,
    encode_batch,
    seq_bytes,
)

log = logging.getLogger("kvtier.observe.events.publisher")  # the name operators already filter on

MAX_BATCH_EVENTS = 1024  # wire events per batch when several publish() calls are coalesced
# a larger encoded batch is split: with the sockets' message-count limits this bounds the bytes
# queued per client (events.subscriber_max_bytes / replay_client_max_bytes)
MAX_MESSAGE_BYTES = 64 << 10
MAX_REPLAY_REQUESTS_PER_WAKE = 16
STREAMING_POLL_MS = 20  # while replay answers wait for their clients to read


class EventSender:
    def __init__(self, handoff: Handoff, *, pub: zmq.Socket, replay: zmq.Socket | None,
                 watches: list[PeerWatch], streams: ReplayStreams, buffer: ReplayBuffer,
                 converter: EventConverter, topic: bytes, data_parallel_rank: int | None,
                 wake_fd: int) -> None:
        self._handoff = handoff
        self._pub = pub
        self._replay = replay
        self._watches = watches
        self._streams = streams
        self._buffer = buffer
        self._converter = converter
        self._topic = topic
        self._dp_rank = data_parallel_rank
        self._wake_fd = wake_fd
        self._seq = 0

    def run(self) -> None:
        h = self._handoff
        poller = zmq.Poller()
        poller.register(self._wake_fd, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        for watch in self._watches:
            poller.register(watch.monitor, zmq.POLLIN)
        idle_ms = int(CHECK_INTERVAL_S * 1000)
        try:
            while True:
                wait = 0 if h.queue else STREAMING_POLL_MS if self._streams else idle_ms
                ready = dict(poller.poll(wait))
                if self._wake_fd in ready:
                    h.signalled = False
                    os.read(self._wake_fd, 4096)
                for watch in self._watches:
                    if watch.monitor in ready:
                        watch.on_events()
                    watch.check()
                if self._replay is not None and self._replay in ready:
                    self._serve_replay()
                if self._streams:
                    self._pump_replay()
                items = h.take()
                if items:
                    self._send_items(items)
                    h.finished(len(items))
                elif h.closing:
                    break
        except Exception:  # noqa: BLE001 - never take the instance down; log once, stop
            log.exception("kvtier events: publisher thread failed; events are off")
        finally:
            self.close_sockets()
            with h.lock:
                h.done.notify_all()

    def close_sockets(self) -> None:
        for watch in self._watches:
            watch.close()
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=500)

    def _send_items(self, items: list[Item]) -> None:
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
            self._handoff.count(send_errors=1)
            self._handoff.lost = True
            return
        if len(payload) > MAX_MESSAGE_BYTES:
            parts = split_batch(batch)
            if parts is not None:
                for part in parts:
                    self._send(part)
                return
        seq = self._seq
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB drops at HWM itself; kept for sockets that do not
            self._handoff.count(send_errors=1)
        self._seq += 1
        self._buffer.append(seq, payload)
        h = self._handoff
        with h.lock:
            h.stats.batches += 1
            h.stats.events += len(batch.events)
            h.stats.access_events += len(batch.access)
            h.stats.last_seq = seq

    def _serve_replay(self) -> None:
        """Take replay requests; each starts a stream (``_pump_replay`` sends it)."""
        assert self._replay is not None
        now = time.monotonic()
        for _ in range(MAX_REPLAY_REQUESTS_PER_WAKE):
            try:
                frames = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            bad = len(frames) != 3 or len(frames[2]) != SEQ_BYTES
            self._handoff.count(replay_requests=1, bad_requests=int(bad))
            if bad:
                if len(frames) >= 2:  # tell the client it is done rather than let it hang
                    self._reply(frames[0], False, END_SEQ, b"")
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            if not self._streams.start(client, start, now):  # busy: the end marker alone
                if self._streams.counts.refused == 1:
                    log.warning("kvtier events: %d replay answers under way; a further request"
                                " gets an empty answer (events.replay_max_clients; logged once)",
                                len(self._streams))
                self._reply(client, False, END_SEQ, b"")

    def _pump_replay(self) -> None:
        counts = self._streams.counts
        gaps, stalled = counts.gaps, counts.stalled
        self._streams.pump(self._reply, time.monotonic())
        if counts.gaps > gaps:
            self._handoff.count(replay_gaps=counts.gaps - gaps)
            self._handoff.gap_seen = True
        if counts.stalled > stalled and stalled == 0:
            log.warning("kvtier events: a replay client stopped reading its answer for %.0f s; "
                        "abandoned (events.stall_timeout_s; logged once)", self._streams.stall_s)

    def _reply(self, client: bytes, with_topic: bool, seq: int, payload: bytes) -> Sent:
        assert self._replay is not None
        topic = self._topic if with_topic else b""
        try:
            self._replay.send_multipart((client, b"", topic, seq_bytes(seq), payload),
                                        flags=zmq.NOBLOCK)
            return Sent.OK
        except zmq.Again:  # its pipe holds replay_client_max_bytes: it has to read first
            return Sent.FULL
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:  # anything but "that client has gone"
                self._handoff.count(send_errors=1)
            return Sent.GONE
