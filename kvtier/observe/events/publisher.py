"""``EventPublisher``: kvtier's KV events on a ZMQ PUB socket, vLLM's wire format, with replay.

The caller (the thread that owns the manager) only appends to a bounded in-memory queue: no
socket call, no encoding, no lock held for longer than an append. One background thread
(``EventSender``, sender.py) owns both sockets; it converts (attaching token ids and parents
through the metadata lookup), encodes, numbers, sends and buffers batches, and answers replay
requests. The two sides share only a ``Handoff`` (handoff.py).

When the queue is full, new events are dropped and counted, and the stream is marked *lost*:
consumers can no longer rebuild state from it. The next ``publish`` then repairs it with a
resync: ``AllBlocksCleared`` followed by ``BlockStored`` for every resident block. With a
resident walk (``kvtier.observe.events.resync``; ``ManagerFeed`` sets one) the blocks go out a
chunk per ``publish`` call, interleaved with live events, so no call walks more than
``DEFAULT_CHUNK`` blocks (a one-shot walk of a large tier would stall vLLM's scheduler thread
for seconds). Without one it sends ``AllBlocksCleared`` alone, so consumers forget this
instance's blocks (a miss, never a wrong hit). A consumer that asked replay for batches no
longer buffered also triggers a resync (at most one per ``min_resync_interval_s``, and none
while one is under way), so a late consumer converges.

Sockets are bound (never connected); a ``tcp`` port of 0 or ``*`` takes any free port and
``endpoint`` / ``replay_endpoint`` then report the real one; ``ipc://`` files are 0600 (bind.py).

Memory held for clients is bounded in bytes, whatever they do (the process is vLLM's
scheduler; the keys and the worst case: docs/security.md): each subscriber's queue (peers.py,
sender.py), the number of connections per socket, stalled clients (peers.py), the replay
buffer and the replay answers under way (replay_streams.py). Drops are counted in ``stats()``
and logged once.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from dataclasses import asdict
from typing import Iterable

import zmq

from kvtier.config.schema import EventsConfig, endpoint_problem
from kvtier.observe.events.bind import bind
from kvtier.observe.events.convert import EventConverter, WireHash
from kvtier.observe.events.handoff import Handoff, Item, PublisherStats
from kvtier.observe.events.metadata import MetadataLookup
from kvtier.observe.events.peers import PeerWatch
from kvtier.observe.events.replay import ReplayBuffer
from kvtier.observe.events.replay_streams import ReplayStreams
from kvtier.observe.events.resync import DEFAULT_CHUNK, ChunkedWalk, ResidentWalk
from kvtier.observe.events.sender import MAX_MESSAGE_BYTES, EventSender
from kvtier.manager import events as mgr

log = logging.getLogger(__name__)


def _messages(max_bytes: int) -> int:
    """A socket's per-client message limit that keeps its queue within ``max_bytes``."""
    return max(2, max_bytes // MAX_MESSAGE_BYTES)


def _remove_ipc_file(endpoint: str | None) -> None:
    """ZMQ removes the file it bound, which bind.py renamed: remove it under its real name."""
    if endpoint is None or not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return
    path = endpoint[len("ipc://"):]
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except OSError:
        pass


class EventPublisher:
    def __init__(
        self,
        config: EventsConfig,
        *,
        block_tokens: int,
        metadata: MetadataLookup | None = None,
        wire_hash: WireHash | None = None,
        data_parallel_rank: int | None = None,
        max_queue_events: int = 100_000,
        replay_max_bytes: int | None = None,
        min_resync_interval_s: float = 1.0,
    ) -> None:
        for name in ("endpoint", "replay_endpoint"):  # EventsConfig checks too; be sure
            value = getattr(config, name)
            problem = None if value is None else endpoint_problem(value, config.allow_remote)
            if problem:
                raise ValueError(f"events.{name}: {problem}")
        self.config = config
        self._converter = EventConverter(block_tokens, metadata, wire_hash)
        self._resident_walk: ResidentWalk | None = None
        self._walk: ChunkedWalk | None = None  # a resync under way (caller's thread only)
        self._max_queue = max_queue_events
        self._min_resync = min_resync_interval_s
        self._buffer = ReplayBuffer(config.buffer_batches, config.replay_max_bytes
                                    if replay_max_bytes is None else replay_max_bytes)
        self._streams = ReplayStreams(self._buffer, max_clients=config.replay_max_clients,
                                      stall_s=config.stall_timeout_s)
        self._watches: list[PeerWatch] = []
        self._handoff = Handoff()
        self._last_resync = float("-inf")

        self._ctx = zmq.Context()
        pub = self._ctx.socket(zmq.PUB)
        replay: zmq.Socket | None = None  # both are the sender's once it runs
        binding = config.endpoint
        try:
            pub.setsockopt(zmq.SNDHWM, _messages(config.subscriber_max_bytes))
            self._watches.append(PeerWatch(pub, max_peers=config.max_subscribers,
                                           stall_s=config.stall_timeout_s,
                                           what="subscriber"))
            self.endpoint = bind(pub, config.endpoint)
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                binding = config.replay_endpoint
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM,
                                        _messages(config.replay_client_max_bytes))
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full client: EAGAIN
                self._watches.append(PeerWatch(replay, max_peers=config.max_subscribers,
                                               stall_s=config.stall_timeout_s,
                                               what="replay client"))
                self.replay_endpoint = bind(replay, config.replay_endpoint)
        except (zmq.ZMQError, OSError) as exc:
            for watch in self._watches:
                watch.close()
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._ctx.term()
            raise OSError(f"kvtier events: cannot bind {binding}: {exc}") from None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        sender = EventSender(self._handoff, pub=pub, replay=replay,
                             watches=self._watches, streams=self._streams, buffer=self._buffer,
                             converter=self._converter, topic=config.topic.encode(),
                             data_parallel_rank=data_parallel_rank, wake_fd=self._wake_r)
        self._thread = threading.Thread(target=sender.run, name="kvtier-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    def publish(self, events: Iterable[mgr.Event]) -> None:
        """Queue manager events (in the order the manager emitted them). Never blocks."""
        events = [e for e in events if e.keys]
        now = time.time()
        if self._resync_due(now):
            self.resync()  # reflects ``events`` already: they need not be sent
            return
        if not events and not self._handoff.lost and self._walk is None:
            return
        with self._handoff.lock:
            if self._handoff.lost and self._handoff.resync_queued:
                # a resync is still waiting for the thread: keep one at a time (bounded
                # memory); these events are dropped and the next publish resyncs again
                self._handoff.stats.dropped_events += len(events)
                return
            if self._handoff.queued_events + len(events) > self._max_queue:
                self._handoff.stats.dropped_events += len(events)
                self._handoff.lost = True
                self._walk = None  # restarted: a dropped event may concern a walked block
                return
            if events or self._handoff.lost:
                item = Item(now, events, cleared=self._handoff.lost)
                self._handoff.lost = False
                self._handoff.enqueue_locked(item)
        self._next_chunk(now)  # after the events: it reads the state they led to
        self._wake()

    def _resync_due(self, now: float) -> bool:
        if self._resident_walk is None or self._handoff.resync_queued:
            return False
        if self._handoff.lost:
            return True
        return (self._handoff.gap_seen and self._walk is None
                and now - self._last_resync >= self._min_resync)

    def _next_chunk(self, now: float) -> None:
        """Queue the next chunk of the resync under way, if the last one has been taken (at
        most one chunk waits, so a stalled thread holds bounded memory)."""
        walk = self._walk
        if walk is None or self._handoff.chunk_queued:
            return
        resident = walk.next_chunk()
        with self._handoff.lock:
            if resident:
                self._handoff.chunk_queued = True
                self._handoff.enqueue_locked(Item(now, [], resident=resident))
            if walk.done:
                self._walk = None

    def resync(self) -> None:
        """Publish ``AllBlocksCleared`` then every resident block (call on the caller's
        thread: the walk must describe the state after every event published so far). This
        queues the clear and the first chunk; each later ``publish`` queues one more chunk
        until the walk is done (``wants_resync`` till then)."""
        if self._resident_walk is None:
            raise RuntimeError("resync needs a resident walk (set_resident_walk)")
        walk = ChunkedWalk(self._resident_walk(), DEFAULT_CHUNK)
        h = self._handoff
        with h.lock:
            self._walk = walk
            h.chunk_queued = False
            h.lost = h.gap_seen = False
            self._last_resync = time.time()
            h.stats.resyncs += 1
            h.sent += len(h.queue)  # queued items are superseded by the snapshot
            h.queue.clear()
            h.queued_events = 0
            h.resync_queued = True
            h.enqueue_locked(Item(self._last_resync, [], cleared=True))
        self._next_chunk(self._last_resync)
        self._wake()

    def set_resident_walk(self, walk: ResidentWalk | None) -> None:
        """A live walk of the resident blocks (``kvtier.observe.events.resync``)."""
        self._resident_walk = walk

    @property
    def wants_resync(self) -> bool:
        """True when consumers cannot rebuild state from the stream until a resync (or the
        resync under way) is done."""
        return self._handoff.lost or self._handoff.gap_seen or self._walk is not None

    def mark_lost(self) -> None:
        """Events were lost before reaching ``publish`` (e.g. the manager's own bus dropped)."""
        self._handoff.lost = True

    def _wake(self) -> None:
        if self._handoff.signalled:
            return
        self._handoff.signalled = True
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (or closed): the thread is awake anyway

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is sent; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._handoff.lock:
            target = self._handoff.enqueued
            while self._handoff.sent < target and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._handoff.done.wait(left)
            return self._handoff.sent >= target

    def stats(self) -> PublisherStats:
        with self._handoff.lock:
            s = PublisherStats(**asdict(self._handoff.stats))
            s.queued = self._handoff.queued_events
        s.metadata_errors = self._converter.metadata_errors
        for watch in self._watches:
            prefix = "subscribers" if watch.what == "subscriber" else "replay_clients"
            setattr(s, prefix, watch.counts.connected)
            setattr(s, f"{prefix}_dropped", watch.counts.dropped)
            setattr(s, f"{prefix}_refused", watch.counts.refused)
        s.replay_busy = self._streams.counts.refused
        s.replay_buffer_bytes = self._buffer.nbytes
        s.replay_stalled = self._streams.counts.stalled
        return s

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout``), then close the sockets."""
        if self._handoff.closing:
            return
        self._handoff.closing = True
        self._handoff.signalled = False
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("kvtier events: publisher thread did not stop within %.1fs", timeout)
            return
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._terminate_context(timeout)
        for endpoint in (self.endpoint, self.replay_endpoint):
            _remove_ipc_file(endpoint)

    def _terminate_context(self, timeout: float) -> None:
        """End the ZMQ context without letting it hold up the caller (vLLM's shutdown) for
        longer than ``timeout``: libzmq's term can wait on a connection to a peer that went
        away mid-answer (a replay client closed while its answer was queued), and was once
        seen waiting for 600 s in the test suite. The sending thread has ended and closed its
        sockets, so closing whatever is left here with no linger is safe."""
        ender = threading.Thread(target=self._ctx.destroy, kwargs={"linger": 0},
                                 name="kvtier-events-term", daemon=True)
        ender.start()
        ender.join(timeout)
        if ender.is_alive():
            log.warning("kvtier events: ZMQ context did not terminate within %.1fs; "
                        "left to end with the process", timeout)

    def __enter__(self) -> "EventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
