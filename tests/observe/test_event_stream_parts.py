"""Issue 36.2, the parts without sockets: a replay answer streamed under a client budget
(pauses when the client is full, announces history evicted while it waited, is abandoned when
the client never reads, refuses clients beyond the cap) and the splitting of an oversized batch
into messages that mean the same."""

from __future__ import annotations

from kvtier.observe.events.replay import ReplayBuffer
from kvtier.observe.events.replay_streams import ReplayStreams, Sent
from kvtier.observe.events.split import split_batch
from kvtier.observe.events.wire import (
    END_SEQ,
    GAP_SEQ,
    BlockAccessed,
    BlockRemoved,
    BlockStored,
    KvtierEventBatch,
    decode_gap,
)


class Client:
    """Takes ``room`` messages, then reports its pipe full until given more room."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.got: list[int] = []
        self.gaps: list = []

    def send(self, client: bytes, with_topic: bool, seq: int, payload: bytes) -> Sent:
        if self.room == 0:
            return Sent.FULL
        self.room -= 1
        if seq == GAP_SEQ:
            self.gaps.append(decode_gap(payload))
        self.got.append(seq)
        return Sent.OK


def _buffer(n: int, max_batches: int = 1000) -> ReplayBuffer:
    buf = ReplayBuffer(max_batches)
    for seq in range(n):
        buf.append(seq, b"x" * 10)
    return buf


def test_an_answer_pauses_while_the_client_is_full_and_resumes_where_it_stopped():
    buf = _buffer(100)
    streams = ReplayStreams(buf, max_clients=2, stall_s=5)
    c = Client(room=10)
    assert streams.start(b"c", 0, now=0.0)
    streams.pump(c.send, now=0.1)
    assert c.got == list(range(10)) and len(streams) == 1
    for t in range(1, 20):
        c.room = 7
        streams.pump(c.send, now=0.1 * t)
    assert c.got == [*range(100), END_SEQ] and len(streams) == 0


def test_history_evicted_while_a_stream_waits_is_announced_as_a_gap():
    buf = _buffer(10, max_batches=10)
    streams = ReplayStreams(buf, max_clients=1, stall_s=5)
    c = Client(room=3)
    streams.start(b"c", 0, now=0.0)
    streams.pump(c.send, now=0.0)  # 0, 1, 2 sent; then the buffer moves on by 20
    for seq in range(10, 30):
        buf.append(seq, b"y")
    c.room = 100
    streams.pump(c.send, now=1.0)
    assert c.got == [0, 1, 2, GAP_SEQ, *range(20, 30), END_SEQ]
    assert (c.gaps[0].requested, c.gaps[0].first_available) == (3, 20)
    assert streams.counts.gaps == 1


def test_a_client_that_never_reads_is_abandoned_and_the_cap_refuses_others():
    streams = ReplayStreams(_buffer(50), max_clients=1, stall_s=5)
    stuck = Client(room=0)
    assert streams.start(b"stuck", 0, now=0.0)
    assert not streams.start(b"other", 0, now=1.0)  # the one slot is taken
    streams.pump(stuck.send, now=4.0)
    assert len(streams) == 1
    streams.pump(stuck.send, now=5.5)
    assert len(streams) == 0 and streams.counts.stalled == 1 and streams.counts.refused == 1
    assert streams.start(b"other", 0, now=6.0)


def test_a_gone_client_ends_its_stream():
    streams = ReplayStreams(_buffer(5), max_clients=1, stall_s=5)
    streams.start(b"c", 0, now=0.0)
    streams.pump(lambda *a: Sent.GONE, now=0.1)
    assert len(streams) == 0


def _stored(hashes, parent=None, block_size=2, tokens=True):
    return BlockStored(list(hashes), parent,
                       [t for h in hashes for t in (h, h)] if tokens else [], block_size,
                       None, "CPU", None, extra_keys=[(h,) for h in hashes])


def test_one_chain_is_split_into_chains_that_mean_the_same():
    ev = _stored(range(1, 8), parent=0)
    a, b = split_batch(KvtierEventBatch(1.0, [ev], 3))
    (ea,), (eb,) = a.events, b.events
    assert ea.block_hashes + eb.block_hashes == ev.block_hashes
    assert ea.parent_block_hash == 0 and eb.parent_block_hash == ea.block_hashes[-1]
    assert ea.token_ids + eb.token_ids == ev.token_ids
    assert len(ea.token_ids) == 2 * len(ea.block_hashes)
    assert ea.extra_keys + eb.extra_keys == ev.extra_keys
    assert a.data_parallel_rank == b.data_parallel_rank == 3 and a.ts == b.ts == 1.0


def test_batches_split_by_event_keep_state_before_access_and_odd_events_stay_whole():
    state = [_stored([i]) for i in range(3)]
    access = [BlockAccessed([10, 11, 12, 13], "CPU", num_tokens=8)]
    a, b = split_batch(KvtierEventBatch(0.0, state, None, access))
    assert a.events + b.events == state and a.access + b.access == access
    assert not (a.access and b.events)  # no state event after an access event
    (x,), (y,) = [p.access for p in split_batch(KvtierEventBatch(0.0, [], None, access))]
    assert x.block_hashes + y.block_hashes == [10, 11, 12, 13]
    assert x.num_tokens + y.num_tokens == 8
    (r1,), (r2,) = [p.events for p in split_batch(
        KvtierEventBatch(0.0, [BlockRemoved([1, 2, 3], "CPU")]))]
    assert r1.block_hashes + r2.block_hashes == [1, 2, 3]
    assert split_batch(KvtierEventBatch(0.0, [_stored([5])])) is None  # one block: indivisible
    bad_tokens = BlockStored([1, 2], None, [1, 2, 3], 2, None, "CPU", None)
    assert split_batch(KvtierEventBatch(0.0, [bad_tokens])) is None  # tokens do not divide
